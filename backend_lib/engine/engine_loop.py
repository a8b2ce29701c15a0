"""Drives an LLMEngine from a background thread; requests come and go from any thread.

submit() validates at once (a bad request raises RequestError in the caller's thread and never
reaches the engine); accepted requests join the running batch at the next step. Each request's
outputs go to its callback, called from the engine thread: callbacks must only hand the output
over (e.g. put it on a queue), never block.

EngineLoop.build(factory) constructs the engine inside the engine thread as well. Then that thread is
the only one that runs the kernels' OpenMP parallel regions: a second OpenMP team (say, the loading
thread's) makes libgomp count more threads than cores and cut its spin-waiting to ~100 spins, so
every parallel region pays a futex wake-up and a batch-1 decode step got ~25 % slower.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable

from ..sampling.params import SamplingParams
from .llm_engine import LLMEngine
from .outputs import RequestOutput

log = logging.getLogger(__name__)

Callback = Callable[[RequestOutput], None]


class EngineLoop:
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], name: str = "engine-loop"):
        """engine: a built engine, or a factory that builds it in the engine thread (see build())."""
        self._factory = engine if callable(engine) and not isinstance(engine, LLMEngine) else None
        self.engine: LLMEngine | None = None if self._factory else engine
        self._cv = threading.Condition()
        self._inbox: deque = deque()
        self._callbacks: dict[str, Callback] = {}
        self._stopping = False
        self.step_count = 0
        self._ready = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    @classmethod
    def build(cls, factory: Callable[[], LLMEngine], name: str = "engine-loop") -> "EngineLoop":
        """Builds the engine in the engine thread and returns once it is ready; the factory's
        exception is raised here if the build fails."""
        loop = cls(factory, name)
        loop._ready.wait()
        if loop._build_error is not None:
            raise loop._build_error
        return loop

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, callback: Callback) -> None:
        self.engine.check_request(prompt_ids, params)
        with self._cv:
            if self._stopping or not self._thread.is_alive():
                raise RuntimeError("engine is not running (shutting down or stopped after a fault)")
            self._inbox.append(("add", request_id, prompt_ids, params, callback))
            self._cv.notify()

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._inbox.append(("abort", request_id))
            self._cv.notify()

    def num_pending(self) -> int:
        with self._cv:
            return sum(1 for item in self._inbox if item[0] == "add")

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops taking requests, cancels what is left, and joins the engine thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    # ----- engine thread ---------------------------------------------------------------------------
    def _deliver(self, out: RequestOutput) -> None:
        cb = self._callbacks.get(out.request_id)
        if out.finished:
            self._callbacks.pop(out.request_id, None)
        if cb is None:
            return
        try:
            cb(out)
        except Exception:
            log.exception("output callback of request %s failed", out.request_id)

    def _drain_inbox(self) -> None:
        with self._cv:
            items = list(self._inbox)
            self._inbox.clear()
        for item in items:
            if item[0] == "add":
                _, rid, ids, params, cb = item
                self._callbacks[rid] = cb
                try:
                    self.engine.add_request(rid, ids, params)
                except Exception as exc:
                    self._deliver(RequestOutput(rid, finished=True, finish_reason="error", error=str(exc)))
            else:
                out = self.engine.abort(item[1])
                if out is not None:
                    self._deliver(out)

    def _main(self) -> None:
        if self._factory is not None:
            try:
                self.engine = self._factory()
            except BaseException as exc:  # reported by build() in the caller's thread
                self._build_error = exc
                self._stopping = True
                self._ready.set()
                return
            finally:
                self._factory = None
        self._ready.set()
        self._run()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._inbox and not self.engine.has_unfinished() and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    break
            self._drain_inbox()
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # scheduler-level fault: fail everything in flight, keep serving
                log.exception("engine step raised; failing all in-flight requests")
                outputs = self.engine.abort_all("error", f"engine fault: {exc}")
            self.step_count += 1
            for out in outputs:
                self._deliver(out)
        self._drain_inbox()
        for out in self.engine.abort_all("cancelled"):
            self._deliver(out)
