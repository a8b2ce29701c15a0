"""The OpenAI front (`python -m openai_frontend`) as a subprocess on a free port: for tests and benchmarks."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from openai import OpenAI

from .triton_server import ROOT, free_port


class Front:
    """`python -m openai_frontend` as a subprocess on a free port."""

    def __init__(self, triton_url: str, log_path, *args, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "openai_frontend", "--triton-url", triton_url, "--port", str(self.port),
               *args]
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self._wait_listening()

    def _wait_listening(self, timeout: float = 60.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, f"the front exited ({self.proc.returncode})"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError("the OpenAI front did not start")

    def client(self, api_key: str = "unused") -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
