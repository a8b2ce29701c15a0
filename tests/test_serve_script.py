"""scripts/serve.sh with stand-ins for the venv's python and tritonserver: it prints the playground's address,
starts the OpenAI front beside the server with the server's ports and address, and the front ends with the
server; OPENAI_FRONT=0 starts the server alone."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from helpers import ROOT

FAKE_PYTHON = """#!/usr/bin/env bash
# stand-in for the venv's python: records `python -m openai_frontend ...` and runs until SIGTERM
echo $$ > "$FAKE_DIR/front.pid"
echo "$@" > "$FAKE_DIR/front.args"
trap 'echo term > "$FAKE_DIR/front.term"; exit 0' TERM
while :; do sleep 0.05; done
"""
FAKE_SERVER = """#!/usr/bin/env bash
# stand-in for the venv's tritonserver: records its arguments, serves for a moment, exits
echo "$@" > "$FAKE_DIR/server.args"
sleep 1.5
"""


def run_serve(tmp_path: Path, **env) -> tuple[subprocess.CompletedProcess, Path]:
    tree = tmp_path / "clone"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "serve.sh", tree / "scripts" / "serve.sh")
    (tree / "scripts" / "setup.sh").write_text("#!/bin/sh\nexit 0\n")
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, text in (("python", FAKE_PYTHON), ("tritonserver", FAKE_SERVER)):
        (fake / name).write_text(text)
    (tree / ".venv" / "bin").mkdir(parents=True)
    (tree / ".venv" / "bin" / "activate").write_text(f'export PATH="{fake}:$PATH"\n')
    for path in (tree / "scripts" / "serve.sh", tree / "scripts" / "setup.sh", fake / "python", fake / "tritonserver"):
        path.chmod(0o755)
    # output to files, as to a terminal: pipes would stay open while the front (a background child) runs, and the
    # exited server would stay an unreaped zombie that the front's watcher still sees alive
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
        proc = subprocess.run(["bash", str(tree / "scripts" / "serve.sh")], stdout=out, stderr=err, timeout=60,
                              env={**os.environ, "FAKE_DIR": str(tmp_path), "QWEN3_A8W8_CHECKPOINT": "/ckpt/a8w8",
                                   "QWEN3_TQ_CHECKPOINT": "/ckpt/bf16",
                                   "QWEN3_EMBED_CHECKPOINT": "/ckpt/embed", **env})
    proc.stdout, proc.stderr = (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
    return proc, tmp_path


def wait_for(path: Path, seconds: float = 10) -> bool:
    deadline = time.time() + seconds
    while not path.exists():
        if time.time() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_serve_starts_the_front_prints_the_playground_and_stops_the_front_with_the_server(tmp_path):
    try:
        check_serve_with_front(tmp_path)
    finally:   # a front left behind by a failure: end it
        if (tmp_path / "front.pid").exists() and not (tmp_path / "front.term").exists():
            subprocess.run(["kill", (tmp_path / "front.pid").read_text().strip()], check=False)


def check_serve_with_front(tmp_path: Path) -> None:
    proc, out = run_serve(tmp_path, GRPC_PORT="18001", FRONT_PORT="19000", METRICS_PORT="18002")
    assert proc.returncode == 0, proc.stderr
    assert "chat playground: http://127.0.0.1:19000/" in proc.stdout
    assert (out / "server.args").read_text().split()[:2] == ["--model-repository", "model_repository"]
    assert "--grpc-port 18001" in (out / "server.args").read_text()
    assert wait_for(out / "front.args")
    assert (out / "front.args").read_text().split() == [
        "-m", "openai_frontend", "--triton-url", "127.0.0.1:18001", "--host", "127.0.0.1", "--port", "19000",
        "--triton-metrics-url", "http://127.0.0.1:18002/metrics", "--log-level", "warning"]
    assert wait_for(out / "front.term", 5), "the front outlived the server"


def test_openai_front_0_serves_without_the_front(tmp_path):
    proc, out = run_serve(tmp_path, OPENAI_FRONT="0")
    assert proc.returncode == 0, proc.stderr
    assert (out / "server.args").exists() and not (out / "front.args").exists()
    assert "python -m openai_frontend" in proc.stdout and "chat playground:" not in proc.stdout
