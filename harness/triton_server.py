"""Starts the real tritonserver (the venv's `tritonserver` command) on free ports: for tests and benchmarks."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_repository(dest: Path, models: dict[str, dict[str, str]]) -> Path:
    """Copies model_repository/<name> for each model, with config.pbtxt parameters replaced.

    An override "_source": "qwen3_a8w8" copies that model under the new name instead. Values are written as pbtxt
    strings (quotes and backslashes escaped), so a JSON parameter (speculative_config) is passed as json.dumps gives it.
    """
    dest.mkdir(parents=True, exist_ok=True)
    for name, overrides in models.items():
        overrides = dict(overrides)
        source = overrides.pop("_source", name)
        src = ROOT / "model_repository" / source
        shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
        cfg = dest / name / "config.pbtxt"
        text = cfg.read_text().replace(f'name: "{source}"', f'name: "{name}"')
        for key, value in overrides.items():
            # a pbtxt string: quotes and backslashes escaped (a JSON value passes as it is)
            quoted = '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
            pattern = rf'(parameters \{{ key: "{key}", value: \{{ string_value: )"[^"]*"'
            text, n = re.subn(pattern, lambda m: m.group(1) + quoted, text)
            if n == 0:
                text += f'parameters {{ key: "{key}", value: {{ string_value: {quoted} }} }}\n'
        cfg.write_text(text)
    return dest


class TritonServer:
    def __init__(self, repository: Path, log_path: Path, env: dict | None = None, extra_args=(),
                 system_server: bool = False):
        """system_server: run as in the container image, where the venv's `tritonserver` (the launcher) finds
        a real server binary on PATH and passes its arguments and environment through unchanged: the
        nvidia-pytriton binary is put first on PATH, with the library path and backend directory that the
        image's server has built in."""
        self.repository, self.log_path = repository, log_path
        self.http_port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
        self.env = {**os.environ, **(env or {})}
        self.env["PATH"] = f"{Path(sys.prefix) / 'bin'}{os.pathsep}{self.env.get('PATH', '')}"
        self.extra_args = list(extra_args)
        if system_server:
            from backend_lib.serving import launcher

            binary, _, libs = launcher.pytriton_paths()
            bin_dir = log_path.parent / "system-bin"
            bin_dir.mkdir(exist_ok=True)
            (bin_dir / "tritonserver").unlink(missing_ok=True)
            (bin_dir / "tritonserver").symlink_to(binary)
            self.env["PATH"] = f"{bin_dir}{os.pathsep}{self.env['PATH']}"
            self.env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(libs), self.env.get("LD_LIBRARY_PATH"))
                                                          if p)
            self.env.pop("QWEN3_TRITONSERVER", None)
            self.extra_args.insert(0, f"--backend-directory={launcher.assemble_backend_dir()}")
        self.proc: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self, timeout: float = 300.0, wait_ready: bool = True, ready_models: list[str] | None = None,
              ) -> "TritonServer":
        """ready_models: wait for these models instead of the whole server (some may be meant to fail)."""
        cmd = [str(Path(sys.prefix) / "bin" / "tritonserver"), "--model-repository", str(self.repository),
               f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}",
               f"--metrics-port={self.metrics_port}", "--http-address=127.0.0.1", "--grpc-address=127.0.0.1",
               "--metrics-address=127.0.0.1"]
        if not any(a.startswith("--log-verbose") for a in self.extra_args):
            cmd.append("--log-verbose=0")
        cmd += self.extra_args
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        if wait_ready:
            self.wait_ready(timeout, ready_models)
        return self

    def wait_ready(self, timeout: float, models: list[str] | None = None) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited ({self.proc.returncode}):\n{self.log_tail()}")
            if models is not None:
                if all(self.model_ready(m) for m in models):
                    return
            else:
                try:
                    with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                        if r.status == 200:
                            return
                except OSError:
                    pass
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {timeout}s:\n{self.log_tail()}")

    def model_ready(self, name: str) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/models/{name}/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def success_count(self, model: str) -> int:
        """The number of requests Triton's statistics extension counts as ended successfully for `model`
        (inference_stats.success.count of GET /v2/models/<model>/stats)."""
        with urllib.request.urlopen(f"http://{self.http_url}/v2/models/{model}/stats", timeout=5) as r:
            [stats] = json.loads(r.read())["model_stats"]
        return int(stats["inference_stats"]["success"]["count"])

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def wait_until(self, condition, seconds: float, poll: float = 0.05) -> bool:
        """Polls condition() (e.g. a metric reaching a value; gauges refresh every 0.1 s) until it holds or
        `seconds` pass; returns whether it held. A connection error counts as not yet (seen in CI: Triton's
        metrics port refused a connection just after the server reported ready)."""
        deadline = time.time() + seconds
        while True:
            try:
                if condition():
                    return True
            except OSError:   # the metrics port may start listening a moment after the server is ready
                pass
            if time.time() >= deadline:
                return False
            time.sleep(poll)

    def finished_total(self, model: str, reason: str) -> float:
        """vllm:request_success_total for one finish reason; 0 before the first (the series appears with it)."""
        try:
            return self.metric("vllm:request_success_total", model, finished_reason=reason)
        except KeyError:
            return 0.0

    def metric_families(self) -> dict:
        """The metrics page parsed by prometheus-client's text parser: {family name: Metric} (counter
        families are named without their _total suffix, as the parser does)."""
        from prometheus_client.parser import text_string_to_metric_families

        return {f.name: f for f in text_string_to_metric_families(self.metrics())}

    def metric(self, name: str, model: str, **labels) -> float:
        """Sum of the samples named `name` (e.g. vllm:prompt_tokens_total, ..._count) for `model` whose labels
        include `labels`."""
        total, found = 0.0, False
        for family in self.metric_families().values():
            for sample in family.samples:
                if sample.name == name and sample.labels.get("model") == model and \
                        all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
                    found = True
        if not found:
            raise KeyError(f"metric {name} for model {model} not found")
        return total

    def _stubs(self) -> dict[int, list[bytes]]:
        """{pid: argv} of every Python-backend stub process of this server's repository (alive or orphaned)."""
        stubs = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmd and cmd[0].endswith(b"triton_python_backend_stub") and len(cmd) > 1 and \
                    str(self.repository).encode() in cmd[1]:
                stubs[int(entry.name)] = cmd
        return stubs

    def stub_instances(self) -> dict[int, str]:
        """{pid: its model instance's name (qwen3_a8w8_0_0)} of every Python-backend stub of this server."""
        return {pid: next((a.decode(errors="replace") for a in cmd if re.fullmatch(rb"[\w.-]+_0_[0-9]+", a)), "?")
                for pid, cmd in self._stubs().items()}

    def stub_pids(self) -> list[int]:
        return sorted(self._stubs())

    def stub_pid(self, model: str) -> int | None:
        """PID of the Python-backend stub process serving `model` (for memory checks)."""
        return next((pid for pid, cmd in self._stubs().items()
                     if any(a.startswith(f"{model}_0_".encode()) for a in cmd)), None)

    def rss_mib(self, model: str) -> float:
        pid = self.stub_pid(model)
        if pid is None:
            raise RuntimeError(f"no stub process found for {model}")
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("VmRSS not found")

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def terminate(self, sig=signal.SIGTERM, timeout: float = 60.0) -> float:
        """Sends `sig` to the server process alone (as `docker stop` or Kubernetes do) and returns the
        seconds until it exited; the stubs it leaves behind are what stub_pids() still lists."""
        t0 = time.time()
        self.proc.send_signal(sig)
        self.proc.wait(timeout=timeout)
        return time.time() - t0

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc:   # a server that crashed leaves its model stubs behind in its process group
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if getattr(self, "_log", None):
            self._log.close()
