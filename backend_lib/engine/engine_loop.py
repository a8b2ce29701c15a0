"""Drives an LLMEngine from a background thread; requests come and go from any thread.

EngineLoop.build(factory) constructs the engine inside the engine thread, which is then the only
thread that touches it: the only one that runs the kernels' OpenMP parallel regions (a second
OpenMP team, say the loading thread's, makes libgomp count more threads than cores and cut its
spin-waiting to ~100 spins, so every parallel region pays a futex wake-up: a batch-1 decode step got
~25 % slower), and the only one that reads or changes the scheduler, the block manager and the
sequences. Other threads send typed messages (AddRequest, AbortRequest) and read `stats`, the
snapshot the engine publishes each step.

submit() validates at once (a bad request raises RequestError in the caller's thread and never
reaches the engine); accepted requests join the running batch at the next step. Each request's
outputs go to its callback, called from the engine thread: callbacks must only hand the output
over (e.g. put it on a queue), never block.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import replace
from typing import Callable

from ..contract.finish import FinishReason
from ..sampling.params import SamplingParams
from .llm_engine import LLMEngine
from .messages import AbortAll, AbortRequest, AddRequest, Callback, EngineStats
from .outputs import RequestOutput

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, factory: Callable[[], LLMEngine], name: str = "engine-loop"):
        """Use EngineLoop.build(factory)."""
        self._factory = factory
        self.engine: LLMEngine | None = None
        self._cv = threading.Condition()
        self._inbox: deque[AddRequest | AbortRequest | AbortAll] = deque()
        self._num_adds = 0                    # AddRequests in the inbox
        self._callbacks: dict[str, Callback] = {}
        self._stopping = False
        self._shutdown_reason = FinishReason.CANCELLED
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

    @property
    def stats(self) -> EngineStats:
        """The engine's latest snapshot, with requests still in the inbox counted as waiting."""
        s = self.engine.stats
        return replace(s, waiting=s.waiting + self._num_adds)

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, callback: Callback) -> None:
        request = self.engine.make_request(request_id, prompt_ids, params)
        with self._cv:
            if self._stopping or not self._thread.is_alive():
                raise RuntimeError("engine is not running (shutting down or stopped after a fault)")
            self._inbox.append(AddRequest(request, callback))
            self._num_adds += 1
            self._cv.notify()

    def abort(self, request_id: str, reason: str = FinishReason.CANCELLED) -> None:
        with self._cv:
            self._inbox.append(AbortRequest(request_id, reason))
            self._cv.notify()

    def abort_all(self, reason: str = FinishReason.ABORT) -> None:
        """Finishes every request in flight or queued (each gets its final output); keeps serving."""
        with self._cv:
            self._inbox.append(AbortAll(reason))
            self._cv.notify()

    def shutdown(self, timeout: float = 30.0, reason: str = FinishReason.CANCELLED) -> None:
        """Stops taking requests, finishes what is left with `reason` (each callback gets its final
        output), and joins the engine thread."""
        with self._cv:
            self._stopping = True
            self._shutdown_reason = reason
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
            self._num_adds = 0
        for item in items:
            if isinstance(item, AddRequest):
                rid = item.request.request_id
                self._callbacks[rid] = item.callback
                try:
                    self.engine.admit(item.request)
                except Exception as exc:
                    self._deliver(RequestOutput(rid, finished=True, finish_reason=FinishReason.ERROR, error=str(exc)))
            elif isinstance(item, AbortAll):
                for out in self.engine.abort_all(item.reason):
                    self._deliver(out)
            else:
                out = self.engine.abort(item.request_id, item.reason)
                if out is not None:
                    self._deliver(out)

    def _main(self) -> None:
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
        engine = self.engine
        while True:
            with self._cv:
                if not self._inbox and not engine.has_unfinished() and not self._stopping:
                    engine.idle()
                while not self._inbox and not engine.has_unfinished() and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    break
            self._drain_inbox()
            if engine.has_unfinished():
                try:
                    outputs = engine.step()
                except Exception as exc:  # scheduler-level fault: fail everything in flight, keep serving
                    log.exception("engine step raised; failing all in-flight requests")
                    outputs = getattr(exc, "outputs", []) + engine.abort_all(FinishReason.ERROR, f"engine fault: {exc}")
                    if getattr(exc, "fatal", False):   # nothing can step again: the thread ends (the model dies)
                        for out in outputs:
                            self._deliver(out)
                        self._stopping = True
                        raise
                for out in outputs:
                    self._deliver(out)
            engine.publish_stats()
        self._drain_inbox()
        for out in engine.abort_all(self._shutdown_reason):
            self._deliver(out)
        engine.publish_stats()
        engine.idle()
