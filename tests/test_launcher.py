"""The project's `tritonserver` command: which server it runs, with what, and how it stops it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from backend_lib.serving import launcher

FAKE_SERVER = textwrap.dedent("""
    import os, signal, sys, time
    out = sys.argv[1]
    def on_term(signum, frame):
        flag = os.environ.get("QWEN3_STOP_FLAG", "")
        with open(out, "w") as f:
            f.write(f"{signum} {int(bool(flag) and os.path.exists(flag))}")
        sys.exit(0)
    if sys.argv[2] == "die":   # a model's engine died: the model writes the file the launcher watches
        with open(os.environ["QWEN3_ENGINE_DEAD"], "a") as f:
            f.write("model qwen3_x: the engine has died\\n")
    if sys.argv[2] in ("hang", "listen"):   # a model process (it ignores SIGTERM) and a model's load marks
        import socket, subprocess
        from backend_lib.serving.launcher import mark_load
        stub = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
        open(out + ".stub", "w").write(str(stub.pid))
        mark_load("qwen3_fast", "loading"); mark_load("qwen3_fast", "ready"); mark_load("qwen3_slow", "loading")
        if sys.argv[2] == "listen":   # Triton opens its ports once every model has loaded
            listener = socket.create_server(("127.0.0.1", int(sys.argv[3])))
    if sys.argv[2] in ("obey", "die", "hang", "listen"):
        signal.signal(signal.SIGTERM, on_term)
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # a server that cannot finish exiting
    open(out + ".ready", "w").close()
    time.sleep(60)
""")


def _supervise_in_thread(tmp_path, mode, kill_after=None, exit_on_death=True, port=None, ready_within=None):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    out = tmp_path / "seen"
    result = {}
    cmd = [sys.executable, str(script), str(out), mode, str(port)]
    endpoint = ("127.0.0.1", port) if port else None

    def run():   # supervise installs signal handlers: only the main thread may; run it in a child python
        code = (f"import sys; from backend_lib.serving import launcher; "
                f"sys.exit(launcher.supervise({cmd!r}, dict(__import__('os').environ), kill_after={kill_after!r}, "
                f"exit_on_death={exit_on_death!r}, endpoint={endpoint!r}, ready_within={ready_within!r}))")
        result["proc"] = subprocess.Popen([sys.executable, "-c", code], cwd=launcher.Path(launcher.__file__).parents[2],
                                          stderr=subprocess.PIPE, text=True)
        result["rc"] = result["proc"].wait(60)
        result["stderr"] = result["proc"].stderr.read()

    t = threading.Thread(target=run)
    t.start()
    deadline = time.time() + 30
    while not (tmp_path / "seen.ready").exists():
        assert time.time() < deadline
        time.sleep(0.05)
    return t, result, out


def test_stop_signal_creates_the_stop_flag_before_the_server_sees_the_signal(tmp_path):
    t, result, out = _supervise_in_thread(tmp_path, "obey")
    t0 = time.time()
    result["proc"].send_signal(signal.SIGTERM)
    t.join(30)
    assert result["rc"] == 0 and time.time() - t0 < 5
    assert out.read_text() == f"{int(signal.SIGTERM)} 1"   # the flag existed when the server got SIGTERM


def test_a_server_that_does_not_exit_is_killed_after_the_grace(tmp_path):
    t, result, out = _supervise_in_thread(tmp_path, "ignore", kill_after=1.0)
    t0 = time.time()
    result["proc"].send_signal(signal.SIGTERM)
    t.join(30)
    assert result["rc"] == 128 + signal.SIGKILL and 0.9 < time.time() - t0 < 10


def test_exit_timeout_defaults_to_five_seconds_and_keeps_the_operators():
    assert launcher.exit_timeout(["--model-repository", "m"]) == (
        ["--model-repository", "m", "--exit-timeout-secs=5"], 5)
    assert launcher.exit_timeout(["--exit-timeout-secs", "20"]) == (["--exit-timeout-secs", "20"], 20)
    assert launcher.exit_timeout(["--exit-timeout-secs=3"]) == (["--exit-timeout-secs=3"], 3)


def test_a_real_tritonserver_on_path_is_run_with_the_arguments_and_environment(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "tritonserver"
    fake.parent.mkdir()
    fake.write_bytes(b"\x7fELF" + b"\0" * 16)   # looks like a server binary
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("QWEN3_TRITONSERVER", raising=False)
    cmd, env = launcher.command(["--model-repository", "model_repository", "--exit-timeout-secs=5"])
    assert cmd == [str(fake), "--model-repository", "model_repository", "--exit-timeout-secs=5"]
    assert env["PATH"] == os.environ["PATH"]


def test_without_a_real_server_the_bundled_one_gets_the_backend_directory(monkeypatch):
    monkeypatch.setenv("QWEN3_TRITONSERVER", "bundled")
    cmd, env = launcher.command(["--model-repository", "m"])
    assert cmd[0].endswith("tritonserver") and cmd[1].startswith("--backend-directory=")
    assert cmd[2:] == ["--model-repository", "m"]
    assert str(launcher.Path(sys.prefix) / "bin") == env["PATH"].split(os.pathsep)[0]
    # the stub runs this Python's own libpython (a shared build), not the system's of the same minor version
    import sysconfig

    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        assert env["LD_LIBRARY_PATH"].split(os.pathsep)[1] == sysconfig.get_config_var("LIBDIR")


def test_an_engine_death_stops_the_server_and_exits_3_for_the_supervisor_to_restart(tmp_path):
    t, result, out = _supervise_in_thread(tmp_path, "die")
    t.join(30)
    assert result["rc"] == launcher.ENGINE_DEAD_EXIT == 3
    assert out.read_text() == f"{int(signal.SIGTERM)} 1"   # drained as on SIGTERM: the stop flag came first
    assert "model qwen3_x: the engine has died; stopping the server (exit status 3)" in result["stderr"]


def test_with_exit_on_engine_death_off_the_server_keeps_running(tmp_path):
    t, result, out = _supervise_in_thread(tmp_path, "die", exit_on_death=False)
    time.sleep(3 * launcher.WATCH_PERIOD_S)
    assert not out.exists() and result["proc"].poll() is None
    result["proc"].send_signal(signal.SIGTERM)
    t.join(30)
    assert result["rc"] == 0 and out.read_text() == f"{int(signal.SIGTERM)} 1"


def test_exit_on_engine_death_is_true_or_false(monkeypatch):
    monkeypatch.delenv(launcher.EXIT_ON_ENGINE_DEATH_ENV, raising=False)
    assert launcher.exit_on_engine_death() is True
    monkeypatch.setenv(launcher.EXIT_ON_ENGINE_DEATH_ENV, "false")
    assert launcher.exit_on_engine_death() is False
    monkeypatch.setenv(launcher.EXIT_ON_ENGINE_DEATH_ENV, "sometimes")
    with pytest.raises(SystemExit, match="QWEN3_EXIT_ON_ENGINE_DEATH='sometimes' is not true or false"):
        launcher.exit_on_engine_death()


def _alive(pid: int) -> bool:
    try:
        return launcher.Path(f"/proc/{pid}").exists() and not launcher._zombie(pid)
    except OSError:
        return False


def test_a_server_whose_model_never_loads_is_stopped_naming_it_and_no_model_process_is_left(tmp_path):
    from harness.triton_server import free_port

    t, result, out = _supervise_in_thread(tmp_path, "hang", port=free_port(), ready_within=2.0)
    stub = int((tmp_path / "seen.stub").read_text())
    t.join(40)
    assert result["rc"] == launcher.LOAD_TIMEOUT_EXIT == 4, result
    assert "not serving 2 s after its start" in result["stderr"]
    assert "still loading: qwen3_slow (" in result["stderr"] and "qwen3_fast" not in result["stderr"]
    assert out.read_text() == f"{int(signal.SIGTERM)} 1"   # stopped as on SIGTERM: the stop flag came first
    assert not _alive(stub), "a model process outlived its server"


def test_a_server_that_serves_in_time_is_left_running(tmp_path):
    from harness.triton_server import free_port

    t, result, out = _supervise_in_thread(tmp_path, "listen", port=free_port(), ready_within=1.0)
    stub = int((tmp_path / "seen.stub").read_text())
    time.sleep(2.5)
    assert result["proc"].poll() is None and not out.exists()
    result["proc"].send_signal(signal.SIGTERM)
    t.join(30)
    assert result["rc"] == 0 and not _alive(stub)


def test_the_serving_endpoint_and_the_ready_timeout(monkeypatch):
    assert launcher.serving_endpoint(["--model-repository", "m"]) == ("127.0.0.1", 8000)
    assert launcher.serving_endpoint(["--http-port=9000", "--http-address", "0.0.0.0"]) == ("127.0.0.1", 9000)
    assert launcher.serving_endpoint(["--allow-http=false", "--grpc-port", "9001"]) == ("127.0.0.1", 9001)
    assert launcher.serving_endpoint(["--allow-http=false", "--allow-grpc=false"]) is None
    monkeypatch.delenv(launcher.READY_TIMEOUT_ENV, raising=False)
    assert launcher.ready_timeout() == launcher.DEFAULT_READY_TIMEOUT_S
    monkeypatch.setenv(launcher.READY_TIMEOUT_ENV, "0")
    assert launcher.ready_timeout() is None
    monkeypatch.setenv(launcher.READY_TIMEOUT_ENV, "soon")
    with pytest.raises(SystemExit, match="QWEN3_READY_TIMEOUT_S"):
        launcher.ready_timeout()
