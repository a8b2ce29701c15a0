"""The documentation site (mkdocs.yml + docs/): `mkdocs build --strict` passes, so no link, anchor or page goes
stale unnoticed; the strict build is shown to fail on a broken link."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import ROOT

pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install the test extra")


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, timeout=300)


def test_the_site_builds_strictly(tmp_path):
    out = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert out.returncode == 0, out.stdout + out.stderr
    pages = nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    for page in pages:
        assert (tmp_path / "site" / ("index.html" if page == "index.md" else page[:-3] + "/index.html")).is_file(), page
    assert {"serving.md", "wire.md", "openai.md", "structured.md", "prefix-caching.md", "deploy.md", "performance.md",
            "reliability.md", "architecture.md"} <= set(pages)


def nav_pages(nav) -> list[str]:
    """Every page file the nav lists (entries are {title: page} or {title: [entries]})."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for entry in nav for p in nav_pages(entry)]
    return [p for value in nav.values() for p in nav_pages(value)]


def test_a_broken_link_fails_the_strict_build(tmp_path):
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    page = tmp_path / "docs" / "index.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    out = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert out.returncode != 0 and "no-such-page.md" in out.stdout + out.stderr
