"""The life of an LLM model process around its engine: the server watch (the stop flag, the server process gone,
SIGTERM to this process), the drain that ends every open stream, and the engine thread's death."""
from __future__ import annotations

import os
import signal
import threading
import time

from ..contract.finish import FinishReason
from .launcher import ENGINE_DEAD_ENV, STOP_FLAG_ENV
from .log import get_logger

log = get_logger()
FINALIZE_TIMEOUT_S = 5.0
STOP_FLAG_POLL_S = 0.1
SIGTERM_GRACE_S = 3.0        # a model process that gets SIGTERM ends its streams, then exits after this at most


class Lifecycle:
    """`exiting`: the server is shutting down (or the model unloading); `dead`: the engine thread died (not a
    shutdown). The watch thread runs until `stop` is set (the model's finalize)."""

    def __init__(self, name: str, pb, loop, publisher, stop: threading.Event):
        self.name, self.pb, self.loop, self.publisher, self._stop = name, pb, loop, publisher, stop
        self.exiting = False
        self.dead = False
        self._sigterm = None
        self._watch = None

    def start(self) -> None:
        self._sigterm = SigtermPipe.install()
        self._watch = threading.Thread(target=self._watch_server, name=f"{self.name}-shutdown-watch", daemon=True)
        self._watch.start()

    def join(self, timeout: float) -> None:
        self._watch.join(timeout=timeout)

    def dead_message(self) -> str:
        return (f"{self.name}: the engine has stopped after a fault (UNAVAILABLE); the model cannot serve until "
                f"it is reloaded or the server restarts")

    def drain(self) -> None:
        """No more calls into the server but response sends: the metrics thread stops, and the engine
        finishes every request in flight with finish_reason 'abort' (their final responses go out) and stops."""
        self.exiting = True
        self.publisher.stop()
        self.loop.shutdown(timeout=FINALIZE_TIMEOUT_S, reason=FinishReason.ABORT)

    def _watch_server(self) -> None:
        """Server shutdown: Triton waits for every open decoupled stream before it finalizes a model, and
        tells the model nothing; the `tritonserver` command of this project (launcher.supervise) creates
        the stop flag named by $QWEN3_STOP_FLAG when it gets SIGTERM/SIGINT, before it passes the signal
        on. Then the metrics thread stops and the engine finishes every request in flight with
        finish_reason 'abort'. Watching a file calls nothing in the server (a readiness query to a server
        that is unloading can wait on the unload itself). It also ends this process if the server process
        is gone, so that no stub outlives its server."""
        flag = os.environ.get(STOP_FLAG_ENV)
        parent = os.getppid()
        sigterm_at = None
        while not self._stop.wait(STOP_FLAG_POLL_S):
            if os.getppid() != parent:
                # The server is gone (killed, or it gave up waiting at its exit timeout): a stub left
                # behind would hold the model's memory for good. Nothing on this path may go through the
                # server (pb_utils logging, metrics, sends would block on it forever): a plain write to
                # stderr, then exit.
                stderr(f"{self.name}: the server process exited; this model process exits too")
                os._exit(0)
            if sigterm_at is None and self._sigterm is not None and self._sigterm.received():
                # SIGTERM to this process (a supervisor that signals the whole group): end the open streams
                # at once, as on the stop flag, and exit unless the server finalizes this model first.
                sigterm_at = time.monotonic()
                stderr(f"{self.name}: SIGTERM; aborting the requests in flight, exiting within "
                       f"{SIGTERM_GRACE_S:g} s")
                if not self.exiting:
                    threading.Thread(target=self.drain, daemon=True).start()
            if sigterm_at is not None and time.monotonic() - sigterm_at > SIGTERM_GRACE_S:
                os._exit(0)
            if flag and not self.exiting and os.path.exists(flag):
                log.info("%s: the server is stopping; aborting the requests in flight", self.name)
                self.drain()
            if not self.exiting and not self.dead and not self.loop.alive:
                self._engine_died()

    def _engine_died(self) -> None:
        """The engine thread is gone (not a shutdown). Triton 2.51 gives a Python model no way to report itself
        not ready but unloading itself, which only --model-control-mode=explicit allows (as vllm_backend's
        health check does). So: every request from now on is refused at once (execute) and the open ones
        fail (the response thread's sweep); the model asks Triton to unload it; and it tells the project's
        launcher, through the file named by $QWEN3_ENGINE_DEAD, which stops the server so that its
        supervisor restarts it (launcher.supervise)."""
        self.dead = True
        log.error("%s: the engine thread has died (its traceback is above); failing its requests with UNAVAILABLE",
                  self.name)
        path = os.environ.get(ENGINE_DEAD_ENV)
        if path:
            try:
                with open(path, "a") as f:
                    f.write(f"model {self.name}: the engine has died\n")
            except OSError:
                log.exception("%s: could not write %s", self.name, path)
        try:
            self.pb.unload_model(self.name)
            log.error("%s: unloading itself (not ready from now on)", self.name)
        except Exception as exc:
            log.warning("%s: cannot unload itself (%s); it stays listed as ready and refuses every request",
                        self.name, exc)


def stderr(message: str) -> None:
    """A log line that does not go through the server (for exit paths where the server may be gone)."""
    try:
        os.write(2, f"[{time.strftime('%H:%M:%S')}] backend_lib: {message}\n".encode(errors="replace"))
    except OSError:
        pass


class SigtermPipe:
    """SIGTERM seen by a thread that is not the main one. The Python backend's stub ignores SIGTERM, and a
    Python-level handler runs only when the main thread executes Python (the stub's main thread waits in
    C++). But CPython's C-level handler also writes the signal number to the wakeup fd, from whatever
    thread the signal lands on; the watch thread reads that pipe."""

    def __init__(self, read_fd: int):
        self._fd = read_fd
        self._seen = False

    @classmethod
    def install(cls) -> "SigtermPipe | None":
        if threading.current_thread() is not threading.main_thread():
            log.debug("SIGTERM handling: initialize does not run in the main thread; not installed")
            return None
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        try:
            signal.signal(signal.SIGTERM, lambda *_: None)
            signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError) as exc:
            log.debug("SIGTERM handling not installed: %s", exc)
            return None
        return cls(r)

    def received(self) -> bool:
        if not self._seen:
            try:
                data = os.read(self._fd, 64)
            except BlockingIOError:
                return False
            except OSError:
                return False
            self._seen = signal.SIGTERM in data
        return self._seen
