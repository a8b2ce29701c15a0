"""`tritonserver` for this venv: a real one on PATH if there is one, else the server from nvidia-pytriton.

With the venv active, `tritonserver --model-repository model_repository [flags]` behaves as in an
NGC container: every flag passes through; this command stays the server's parent to drain it on a
stop signal (see supervise). Without a system tritonserver it runs the 2.51 server
shipped in the nvidia-pytriton wheel, with a backend directory assembled from that wheel (the
Python backend plus the stub built for this Python version) and this venv first on PATH, so the
stub imports the venv's packages (torch, backend_lib).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

STUB = "triton_python_backend_stub"


def _is_self(path: Path) -> bool:
    try:
        return path.resolve() == Path(sys.argv[0]).resolve() or path.resolve().parent == Path(sys.prefix, "bin").resolve()
    except OSError:
        return False


def find_system_tritonserver() -> Path | None:
    """The first `tritonserver` on PATH that is not this wrapper (QWEN3_TRITONSERVER overrides)."""
    forced = os.environ.get("QWEN3_TRITONSERVER")
    if forced:
        return Path(forced) if forced != "bundled" else None
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        cand = Path(entry or ".") / "tritonserver"
        if cand.is_file() and os.access(cand, os.X_OK) and not _is_self(cand):
            head = cand.read_bytes()[:4]
            if head == b"\x7fELF":   # a real server binary, not another Python wrapper
                return cand
    return None


def pytriton_paths() -> tuple[Path, Path, Path]:
    """(tritonserver binary, backends dir of the wheel, nvidia_pytriton.libs)."""
    import pytriton

    root = Path(pytriton.__file__).parent
    dist = root / "tritonserver"
    libs = root.parent / "nvidia_pytriton.libs"
    if not (dist / "bin" / "tritonserver").is_file():
        raise SystemExit(f"tritonserver: {dist / 'bin' / 'tritonserver'} not found in the nvidia-pytriton wheel")
    return dist / "bin" / "tritonserver", dist / "backends", libs


def assemble_backend_dir() -> Path:
    """backends/python from the wheel plus the stub for this Python, in a folder of the venv (made once)."""
    _, backends, _ = pytriton_paths()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = backends.parent / "python_backend_stubs" / version / STUB
    if not stub.is_file():
        raise SystemExit(f"tritonserver: nvidia-pytriton ships no Python backend stub for Python {version}")
    key = hashlib.sha256(f"{backends}:{stub.stat().st_size}:{stub.stat().st_mtime}".encode()).hexdigest()[:12]
    target = Path(sys.prefix) / "var" / "qwen3_triton" / f"backends-{key}"
    if not (target / "python" / STUB).is_file():
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(backends, tmp, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(stub, tmp / "python" / STUB)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def python_libdir() -> str | None:
    """The folder of this Python's shared libpython, when it has one. The stub links libpython3.X.so.1.0 by
    name, and the loader would otherwise take the system's (say Debian's 3.11.2) under this venv's standard
    library (say pyenv's 3.11.7), whose C modules then miss symbols (`import ssl` fails in the model)."""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return None
    libdir = sysconfig.get_config_var("LIBDIR")
    return libdir if libdir and (Path(libdir) / sysconfig.get_config_var("LDLIBRARY")).exists() else None


def bundled_command(args: list[str]) -> tuple[list[str], dict[str, str]]:
    binary, _, libs = pytriton_paths()
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(libs), python_libdir() or "", env.get("LD_LIBRARY_PATH", "")) if p)
    venv_bin = str(Path(sys.prefix) / "bin")
    env["PATH"] = os.pathsep.join([venv_bin] + [p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin])
    if sys.prefix != sys.base_prefix:
        env.setdefault("VIRTUAL_ENV", sys.prefix)
    repo_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH", "")) if p)
    if not any(a == "--backend-directory" or a.startswith("--backend-directory=") for a in args):
        args = [f"--backend-directory={assemble_backend_dir()}"] + args
    return [str(binary)] + args, env


STOP_FLAG_ENV = "QWEN3_STOP_FLAG"
ENGINE_DEAD_ENV = "QWEN3_ENGINE_DEAD"            # file a model writes when its engine has died
EXIT_ON_ENGINE_DEATH_ENV = "QWEN3_EXIT_ON_ENGINE_DEATH"
ENGINE_DEAD_EXIT = 3                              # this command's exit status after an engine death
LOAD_STATUS_ENV = "QWEN3_LOAD_STATUS"            # folder where each model marks its load: <model>.loading/.ready
READY_TIMEOUT_ENV = "QWEN3_READY_TIMEOUT_S"      # the server must serve within this many seconds of its start
DEFAULT_READY_TIMEOUT_S = 900.0                  # the 0.6B demo loads in ~1 min cold on 2 cores; an 8B in a few
LOAD_TIMEOUT_EXIT = 4                            # this command's exit status when the server never got ready


def mark_load(model: str, state: str) -> None:
    """A model's load progress ('loading' at the start of initialize, 'ready' at its end) for the launcher's
    readiness watchdog (supervise), as a file in $QWEN3_LOAD_STATUS; nothing when the variable is unset."""
    folder = os.environ.get(LOAD_STATUS_ENV)
    if not folder:
        return
    try:
        if state == "ready":
            (Path(folder) / f"{model}.loading").unlink(missing_ok=True)
        (Path(folder) / f"{model}.{state}").write_text(f"{os.getpid()} {time.time():.3f}\n")
    except OSError:
        pass


def load_report(folder: Path, now: float | None = None) -> str:
    """Which models hold the server's start (for the line the readiness watchdog logs)."""
    now = time.time() if now is None else now
    loading, ready = [], []
    for path in sorted(folder.glob("*.loading")) + sorted(folder.glob("*.ready")):
        try:
            since = float(path.read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
        (loading if path.suffix == ".loading" else ready).append(f"{path.stem} ({now - since:.0f} s)")
    if loading:
        return "still loading: " + ", ".join(loading) + " (time since its initialize started)"
    if ready:
        return ("every Python model finished initialize (" + ", ".join(ready) + " ago), but the server has not "
                "marked them loaded")
    return "no Python model reported its load"
WATCH_PERIOD_S = 0.2


def command(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The server command and environment: a real tritonserver on PATH, else the bundled one."""
    system = find_system_tritonserver()
    if system is not None:
        return [str(system)] + args, dict(os.environ)
    return bundled_command(args)


PARTITION_ENV = "QWEN3_CPU_PARTITION"             # "off": leave the LLM models' cores to their own parameters;
                                                  # "static": each model its fixed share (no work-conserving)
LLM_MARKER = "TritonLLMModel"                     # what an LLM model's model.py is built on


def _arg_values(args: list[str], name: str) -> list[str]:
    out = []
    for i, a in enumerate(args):
        if a.startswith(name + "="):
            out.append(a.split("=", 1)[1])
        elif a == name and i + 1 < len(args):
            out.append(args[i + 1])
    return out


def llm_models(args: list[str]) -> list[tuple[str, Path]]:
    """(name, folder) of the LLM models the server will load: every one in the repositories, or those named
    by --load-model under --model-control-mode=explicit."""
    explicit = "explicit" in _arg_values(args, "--model-control-mode")
    wanted = set(_arg_values(args, "--load-model"))
    out = []
    for repo in _arg_values(args, "--model-repository"):
        for folder in sorted(Path(repo).iterdir()) if Path(repo).is_dir() else []:
            code = list(folder.glob("*/model.py"))
            if (folder / "config.pbtxt").is_file() and code and LLM_MARKER in code[0].read_text(errors="replace"):
                if not explicit or folder.name in wanted or "*" in wanted:
                    out.append((folder.name, folder))
    return out


def cpu_partition(args: list[str], env: dict[str, str], share_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """The environment with the LLM models' cores (backend_lib/cpu_policy.py), except where the operator chose
    (the variable or a cpu_cores/num_threads parameter): by default $<MODEL>_CPU_SHARE, every such model a slot
    of one share file in `share_dir` (work-conserving: a model busy alone computes on every core, busy ones
    split them); with $QWEN3_CPU_PARTITION=static $<MODEL>_CPU_CORES, each its fixed share. And libgomp's
    short spin unless GOMP_SPINCOUNT / OMP_WAIT_POLICY are set."""
    from .. import cpu_policy

    env = dict(env)
    if not any(k in env for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")):
        env["GOMP_SPINCOUNT"] = cpu_policy.SPIN_COUNT
    mode = env.get(PARTITION_ENV, "").strip().lower()
    if mode in ("off", "false", "0"):
        return env
    free = []
    for name, folder in llm_models(args):
        pbtxt = (folder / "config.pbtxt").read_text(errors="replace")
        chosen = any(f'key: "{k}"' in pbtxt for k in ("cpu_cores", "num_threads", "cpu_share")) or any(
            f"{name.upper()}_{k}" in env for k in ("CPU_CORES", "NUM_THREADS", "CPU_SHARE"))
        if not chosen:
            free.append(name)
    cores = cpu_policy.available_cores()
    shares = cpu_policy.partition(free, cores)
    if not shares:
        return env
    if mode == "static":
        for name, share in shares.items():
            env[f"{name.upper()}_CPU_CORES"] = share
        print("[tritonserver] cores per LLM model: " + ", ".join(f"{n} {c}" for n, c in shares.items())
              + f" (${PARTITION_ENV}=off or a model's cpu_cores / num_threads changes this)", file=sys.stderr,
              flush=True)
        return env
    path = cpu_policy.create_share_file(Path(share_dir or tempfile.mkdtemp(prefix="qwen3-cpu-")) / "busy", len(free))
    for slot, name in enumerate(free):
        env[f"{name.upper()}_CPU_SHARE"] = cpu_policy.format_share(path, slot, cores)
    print(f"[tritonserver] cores {cpu_policy.format_cores(cores)} shared by the LLM models "
          + ", ".join(free) + ": a model busy alone computes on all of them, busy ones split them ("
          + ", ".join(f"{n} {c}" for n, c in shares.items())
          + f"; ${PARTITION_ENV}=static fixes that split, =off or a model's cpu_cores / num_threads leaves "
          "them to the models)", file=sys.stderr, flush=True)
    return env


def exit_on_engine_death() -> bool:
    raw = os.environ.get(EXIT_ON_ENGINE_DEATH_ENV, "true").strip().lower()
    if raw not in ("true", "false", "1", "0"):
        raise SystemExit(f"tritonserver: ${EXIT_ON_ENGINE_DEATH_ENV}={raw!r} is not true or false")
    return raw in ("true", "1")


def serving_endpoint(args: list[str]) -> tuple[str, int] | None:
    """Where the server answers once it has loaded its models (Triton opens its endpoints only then): the HTTP
    port, else the gRPC port; None when both are off."""
    for proto, default in (("http", 8000), ("grpc", 8001)):
        allowed = (_arg_values(args, f"--allow-{proto}") or ["true"])[-1].lower()
        if allowed in ("false", "0", "off", "no"):
            continue
        port = int((_arg_values(args, f"--{proto}-port") or [default])[-1])
        host = (_arg_values(args, f"--{proto}-address") or ["127.0.0.1"])[-1]
        if host in ("", "0.0.0.0"):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        return host, port
    return None


def _answers(endpoint: tuple[str, int]) -> bool:
    try:
        with socket.create_connection(endpoint, timeout=1.0):
            return True
    except OSError:
        return False


def ready_timeout() -> float | None:
    raw = os.environ.get(READY_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_READY_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise SystemExit(f"tritonserver: ${READY_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    return value if value > 0 else None   # 0: no watchdog


def processes_with_env(marker: str) -> list[int]:
    """PIDs (other than this one) whose environment holds `marker` (NAME=value): the server and the model
    processes it started, which inherit this command's environment."""
    needle = marker.encode()
    out = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                out.append(int(entry.name))
        except OSError:
            continue
    return out


def reap_leftovers(marker: str, grace: float = 2.0) -> list[int]:
    """After the server is gone: ends every model process it left behind (SIGTERM, then SIGKILL)."""
    pids = processes_with_env(marker)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if Path(f"/proc/{p}").exists() and not _zombie(p)]
            time.sleep(0.05)
        if not pids:
            break
    return pids


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def supervise(cmd: list[str], env: dict[str, str], kill_after: float | None = None,
              exit_on_death: bool = True, endpoint: tuple[str, int] | None = None,
              ready_within: float | None = None) -> int:
    """Runs the server as a child and drains it on SIGTERM/SIGINT/SIGHUP before passing the signal on.

    Triton waits for every open decoupled stream before it unloads a model, and nothing in the Python
    backend tells a model that the server is stopping (asking Triton for the model's readiness while it
    unloads can wait on the unload itself). So this process, which receives the signal (`docker stop`,
    Kubernetes and a terminal send it to the main process), first creates the stop flag whose path the
    models read from $QWEN3_STOP_FLAG: each model finishes its open streams at once (finish_reason
    'abort'), then Triton unloads and exits promptly. A server still running `kill_after` seconds after
    the signal (Triton 2.51 cannot finish exiting while a client holds a stream open) is killed; its model
    processes follow (they end themselves when their server is gone).

    Engine death: a model whose engine thread has died answers every request with UNAVAILABLE at once,
    and writes a line to the file named by $QWEN3_ENGINE_DEAD. Triton 2.51's Python backend cannot mark a
    model not ready (a model may unload itself only under --model-control-mode=explicit, see
    docs/deploy.md), so /v2/health/ready would go on answering 200 for a replica that cannot serve. With
    exit_on_death this process then stops the server as on SIGTERM and exits with ENGINE_DEAD_EXIT, so
    that its supervisor (Kubernetes, `docker run --restart`, systemd) starts a fresh one.

    Readiness: a server that does not answer at `endpoint` within `ready_within` seconds (a model whose load
    hangs: Triton opens its ports only once every model has loaded or failed) is stopped the same way; this
    command logs which models hold it (each model marks its load in $QWEN3_LOAD_STATUS) and exits with
    LOAD_TIMEOUT_EXIT. However the server ends, no model process outlives it: those still running after it
    (found by this run's stop-flag path in their environment) are ended.
    """
    stamp = f"{os.getpid()}-{time.time_ns()}"
    flag = Path(tempfile.gettempdir()) / f"qwen3-triton-stop-{stamp}"
    dead = Path(tempfile.gettempdir()) / f"qwen3-triton-engine-dead-{stamp}"
    status = Path(tempfile.mkdtemp(prefix=f"qwen3-triton-load-{stamp}-"))
    env = {**env, STOP_FLAG_ENV: str(flag), ENGINE_DEAD_ENV: str(dead), LOAD_STATUS_ENV: str(status)}
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env=env)

    def forward(signum, _frame):
        first = not flag.exists()
        try:
            flag.touch()
        except OSError:
            pass
        proc.send_signal(signum)
        if first and kill_after is not None:
            threading.Thread(target=kill_if_alive, daemon=True).start()

    def kill_if_alive():
        try:
            proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            print(f"[tritonserver] still running {kill_after:.0f} s after the stop signal: killing it", file=sys.stderr,
                  flush=True)
            proc.kill()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    died = hung = False
    serving = endpoint is None or ready_within is None
    try:
        while True:
            try:
                rc = proc.wait(timeout=WATCH_PERIOD_S)
                break
            except subprocess.TimeoutExpired:
                pass
            if not serving and not flag.exists():
                if _answers(endpoint):
                    serving = True
                elif time.monotonic() - started > ready_within:
                    hung = serving = True
                    print(f"[tritonserver] not serving {ready_within:.0f} s after its start "
                          f"(${READY_TIMEOUT_ENV}): {load_report(status)}; stopping the server (exit status "
                          f"{LOAD_TIMEOUT_EXIT}) so that its supervisor restarts it", file=sys.stderr, flush=True)
                    forward(signal.SIGTERM, None)
            if exit_on_death and not died and dead.exists():
                died = True
                what = dead.read_text(errors="replace").strip() or "a model's engine died"
                print(f"[tritonserver] {what}; stopping the server (exit status {ENGINE_DEAD_EXIT}) so that its "
                      f"supervisor restarts it (${EXIT_ON_ENGINE_DEATH_ENV}=false keeps it running)",
                      file=sys.stderr, flush=True)
                forward(signal.SIGTERM, None)
    finally:
        if proc.poll() is not None:
            left = reap_leftovers(f"{STOP_FLAG_ENV}={flag}")
            if left:
                print(f"[tritonserver] model processes {left} did not end", file=sys.stderr, flush=True)
        flag.unlink(missing_ok=True)
        dead.unlink(missing_ok=True)
        shutil.rmtree(status, ignore_errors=True)
    if died:
        return ENGINE_DEAD_EXIT
    if hung:
        return LOAD_TIMEOUT_EXIT
    return rc if rc >= 0 else 128 - rc


DEFAULT_EXIT_TIMEOUT_S = 5
KILL_GRACE_S = 3


def exit_timeout(args: list[str]) -> tuple[list[str], int]:
    """(args with --exit-timeout-secs, its value). Triton waits that long (30 s by default) for every model
    to unload. Ours end their streams as soon as the stop flag appears; what can still hold a model is a
    client that keeps its gRPC stream open after the final response, which Triton 2.51 waits for (and then
    cannot exit cleanly at all). 5 s unless the operator says otherwise."""
    for i, a in enumerate(args):
        if a.startswith("--exit-timeout-secs="):
            return args, int(a.split("=", 1)[1])
        if a == "--exit-timeout-secs" and i + 1 < len(args):
            return args, int(args[i + 1])
    return args + [f"--exit-timeout-secs={DEFAULT_EXIT_TIMEOUT_S}"], DEFAULT_EXIT_TIMEOUT_S


def main(argv: list[str] | None = None) -> None:
    args, timeout = exit_timeout(list(sys.argv[1:] if argv is None else argv))
    exit_on_death = exit_on_engine_death()
    cmd, env = command(args)
    share_dir = tempfile.mkdtemp(prefix="qwen3-cpu-")
    try:
        env = cpu_partition(args, env, share_dir)
        rc = supervise(cmd, env, kill_after=timeout + KILL_GRACE_S, exit_on_death=exit_on_death,
                       endpoint=serving_endpoint(args), ready_within=ready_timeout())
    finally:
        shutil.rmtree(share_dir, ignore_errors=True)
    sys.exit(rc)


if __name__ == "__main__":
    main()
