"""The Triton Python-backend model of an LLM (decoupled): thin glue between Triton and the engine.

execute() validates each request and hands it to the EngineLoop; a response thread of its own
turns engine outputs into Triton responses (never the decode loop), checks cancellation in a
periodic sweep (not per output: is_cancelled() is a round trip to the server process), and aborts
cancelled requests in the engine, which frees their pages at once. The model reads engine state
only through the loop's stats snapshot.

This module is the Triton I/O; the rest of the job is in its neighbours: the n choices (`choices`), the
abort tokens (`abort_tokens`), the process's life around the engine (`lifecycle`: server watch, SIGTERM,
engine death) and what each engine output sends (`collect`, over `responses`).
"""
from __future__ import annotations

import json
import queue
import threading
import time

import numpy as np

from ..contract.errors import RequestError
from ..contract.finish import FinishReason
from .abort_tokens import AbortTokens
from .choices import ChoiceGroup, ChoiceSender, fork
from .collect import RequestState
from .request import AbortRequest, parse_abort, parse_request
from .responses import abort_token_arrays
from .schema import LLM_INPUTS, LLM_OUTPUTS, declare
from .launcher import mark_load
from .lifecycle import FINALIZE_TIMEOUT_S, Lifecycle
from .log import get_logger, setup as setup_logging
from .metrics import FinishedRequest
from .triton_config import engine_config_from_args

log = get_logger()
CANCEL_SWEEP_S = 0.1
# A sweep asks the server, per open request, whether its client cancelled (one round trip each): with many open
# requests on a loaded host one sweep can take longer than CANCEL_SWEEP_S, and sweeping again after every single
# output then starved the responses queued behind (an abort's final response among them: the front's abort
# fallback fired, tests/test_openai_server.py's disconnect storm). The next sweep waits SWEEP_SPACING times as
# long as the last one took, so sweeps take at most 1 / (1 + SWEEP_SPACING) of the response thread.
SWEEP_SPACING = 4.0
FINAL_METRICS_WAIT_S = 0.05


class Overloaded(Exception):
    """The waiting queue is full: refuse at once rather than queue without bound."""


class EngineDead(Exception):
    """The engine thread has died: every request is refused at once (UNAVAILABLE)."""


class SweepPacer:
    """When the response thread sweeps for cancelled requests next: CANCEL_SWEEP_S after the last sweep ended, or
    SWEEP_SPACING times its duration when that is longer (see SWEEP_SPACING)."""

    def __init__(self):
        self.next_at = 0.0

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def swept(self, started: float, ended: float) -> None:
        self.next_at = ended + max(CANCEL_SWEEP_S, SWEEP_SPACING * (ended - started))


class TritonLLMModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        """The I/O of every LLM model comes from the schema table; config.pbtxt holds what an operator edits,
        max_batch_size included: 0 (the default) takes vllm_backend's tensor shapes (a scalar is [1]), 1 takes
        TensorRT-LLM's (a batch dimension first: a scalar is [1, 1], as Triton's OpenAI frontend sends to a
        model whose backend is not vllm). Triton checks every input's rank against the config, so one model
        takes one of the two; the engine batches requests itself, so no other value means anything."""
        declare(auto_complete_model_config, LLM_INPUTS, LLM_OUTPUTS)
        batch = auto_complete_model_config.as_dict().get("max_batch_size", 0)
        if batch not in (0, 1):
            raise ValueError(f"max_batch_size {batch}: an LLM model takes 0 (inputs shaped as vllm_backend's, a "
                             "scalar [1]) or 1 (TensorRT-LLM's, a scalar [1, 1]); the engine batches requests "
                             "itself")
        auto_complete_model_config.set_max_batch_size(batch)
        auto_complete_model_config.set_model_transaction_policy({"decoupled": True})
        return auto_complete_model_config

    def initialize(self, args):
        import triton_python_backend_utils as pb_utils

        from ..engine import EngineLoop, LLMEngine
        from .metrics import EngineMetrics, MetricsBuffer, MetricsPublisher

        setup_logging(pb_utils)
        self.pb = pb_utils
        self.name = args["model_name"]
        mark_load(self.name, "loading")
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException(f"{self.name}: model_transaction_policy.decoupled must be true")
        self.batched = model_config.get("max_batch_size", 0) > 0   # TensorRT-LLM shapes: outputs get [1, ...]
        cfg = engine_config_from_args(args)
        self.cfg = cfg
        log.info("%s: loading %s on %s (%s KV cache)", self.name, cfg.checkpoint, cfg.device, cfg.kv_cache)
        log.debug("%s: engine configuration %s", self.name, cfg)
        # Built in the engine thread: one OpenMP team in the process (see EngineLoop.build).
        self.loop = EngineLoop.build(lambda: LLMEngine(cfg), name=f"{self.name}-engine")
        self.engine = self.loop.engine   # immutable parts only (tokenizer, make_params): see LLMEngine
        self.metrics = MetricsBuffer()
        self.publisher = MetricsPublisher(
            EngineMetrics(pb_utils, {"model": self.name, "version": args.get("model_version", "1")},
                          self.engine.max_model_len, cfg.max_loras if self.engine.lora is not None else None,
                          self.engine.lora.configured if self.engine.lora is not None else (),
                          # [spec] the spec_decode counters, when speculative decoding is on
                          self.engine.spec.cfg.num_speculative_tokens if self.engine.spec is not None else None),
            self.metrics,
            lambda: self.loop.stats, name=f"{self.name}-metrics")
        self._queue: queue.Queue = queue.Queue()
        self._active: dict[str, RequestState] = {}
        self._tokens = AbortTokens()      # the abort capability -> its request
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.life = Lifecycle(self.name, pb_utils, self.loop, self.publisher, self._stop)
        self._thread = threading.Thread(target=self._respond_loop, name=f"{self.name}-responses", daemon=True)
        self._thread.start()
        self.life.start()
        mark_load(self.name, "ready")
        log.info("%s: ready", self.name)

    # ----- Triton entry points ---------------------------------------------------------------------
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._submit(request, sender)
            except RequestError as exc:
                self._send_error(sender, str(exc), self.pb.TritonError.INVALID_ARG)
            except (Overloaded, EngineDead) as exc:
                self._send_error(sender, str(exc), self.pb.TritonError.UNAVAILABLE)
            except Exception:
                log.exception("%s: request failed before reaching the engine", self.name)
                self._send_error(sender, "internal error (logged by the server)", self.pb.TritonError.INTERNAL)
        return None

    def finalize(self):
        """Unload or server shutdown: every open stream gets its final response (finish_reason 'abort') at
        once, then the threads end. Nothing here waits on the server process beyond those sends: the
        metrics thread stops first (a metrics call to a server that is going away can block forever)."""
        log.info("%s: finalizing", self.name)
        self.life.drain()
        self._stop.set()
        self._thread.join(timeout=FINALIZE_TIMEOUT_S)
        self.life.join(timeout=1.0)
        log.info("%s: finalized", self.name)

    # ----- requests --------------------------------------------------------------------------------
    def _submit(self, request, sender) -> None:
        if self.life.dead or (not self.loop.alive and not self.life.exiting):
            raise EngineDead(self.life.dead_message())
        inputs = {t.name(): t.as_numpy() for t in request.inputs()}
        parameters = request.parameters()
        abort = parse_abort(inputs, parameters)
        if abort is not None:
            self._abort_with_token(abort, sender)
            return
        req = parse_request(inputs, parameters, self.cfg.limits.max_prompt_bytes)
        waiting = self.loop.stats.waiting
        if waiting >= self.cfg.max_waiting_requests:
            raise Overloaded(f"server overloaded (UNAVAILABLE): {waiting} requests are waiting "
                             f"(max_waiting_requests {self.cfg.max_waiting_requests}); retry later")
        prompt_ids = req.input_ids if req.input_ids is not None else self.engine.tokenizer.encode(req.text)
        choices = fork(req, self.name, self.engine.make_params)
        if req.n > 1:   # every choice valid before any runs (the loop validates again in submit)
            for rid, params in choices:
                self.engine.make_request(rid, prompt_ids, params)
        group = None
        if req.n > 1:
            group = ChoiceGroup(sender, req.n, self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL, self.loop.abort)
        arrival = time.perf_counter()
        states = []
        for j, (rid, _) in enumerate(choices):
            state = RequestState(rid, request.request_id(), sender if group is None else ChoiceSender(group, j),
                                 req, prompt_ids, arrival, index=j, group=group)
            if j:
                state.abort_token = states[0].abort_token   # one capability aborts every choice
            states.append(state)
        if group is not None:
            group.states = states
        first = states[0]
        with self._lock:
            for state in states:
                self._active[state.rid] = state
            self._tokens.register(first.abort_token, first)
        if req.return_abort_token:   # before any token: the sender can abort from its first response on
            try:
                self._send(first, abort_token_arrays(first.abort_token), 0)
            except Exception:   # the client is gone already: nothing to generate for
                log.info("%s: request %s: its client left before admission", self.name, first.rid)
                for state in states:
                    self._close(state)
                return
        submitted = []
        for state, (rid, params) in zip(states, choices):
            try:
                self.loop.submit(rid, prompt_ids, params, lambda out, s=state: self._queue.put((s, out)))
            except Exception:
                for s in submitted:
                    self.loop.abort(s.rid)
                for s in states:
                    self._close(s)
                raise
            submitted.append(state)
            self.metrics.record(prompt_tokens=len(prompt_ids))

    def _abort_with_token(self, abort: AbortRequest, sender) -> None:
        """An abort request: it ends the request whose abort token it presents (with that request's id),
        and no other (abort_tokens.AbortTokens.match)."""
        state, finished = self._tokens.match(abort)
        if state is not None:
            log.info("%s: request %s aborted by its client", self.name, state.rid)
            for s in (state.group.states if state.group is not None else [state]):
                self.loop.abort(s.rid, reason=FinishReason.ABORT)
        else:
            log.info("%s: abort of request %s: it had finished before its abort arrived", self.name, finished)
        sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _send_error(self, sender, message: str, code) -> None:
        err = self.pb.TritonError(message, code)
        sender.send(self.pb.InferenceResponse(output_tensors=[], error=err),
                    flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _count_final(self, state: RequestState, reason: str) -> None:
        """Counts a finished request and lets the metrics thread publish it before the final response goes
        out (bounded: a stalled metrics call delays a final response by FINAL_METRICS_WAIT_S at most). Never raises:
        it runs after the request is closed and before its final send, which a failure here would skip, leaving
        the client waiting for good."""
        try:
            self.metrics.record(finished=FinishedRequest(reason, time.perf_counter() - state.arrival,
                                                         len(state.prompt_ids), state.generated,
                                                         state.req.sampling.get("lora_name")))
            if not self.life.exiting:
                self.publisher.flush(wait=FINAL_METRICS_WAIT_S)
        except Exception:
            log.exception("%s: counting request %s failed; its final response goes out all the same", self.name,
                          state.rid)

    # ----- response thread -------------------------------------------------------------------------
    def _respond_loop(self) -> None:
        pacer, slow_logged = SweepPacer(), -60.0
        while not (self._stop.is_set() and self._queue.empty()):
            try:
                state, out = self._queue.get(timeout=CANCEL_SWEEP_S)
                try:
                    self._handle(state, out)
                except Exception:   # e.g. the client is gone: stop generating for it
                    log.exception("%s: sending a response failed; aborting %s", self.name, state.rid)
                    if not state.done:   # else it was closed and counted before its final send
                        if not out.finished:
                            self.loop.abort(state.rid)
                        self._close(state)
                        self._count_final(state, FinishReason.CANCELLED)
            except queue.Empty:
                pass
            if pacer.due(time.perf_counter()) and not self.life.exiting:
                started = time.perf_counter()
                try:
                    self._sweep_cancelled()
                except Exception:
                    log.exception("%s: cancellation sweep failed", self.name)
                ended = time.perf_counter()
                pacer.swept(started, ended)
                if ended - started > CANCEL_SWEEP_S and ended - slow_logged >= 60.0:   # one line a minute at most
                    slow_logged = ended
                    log.info("%s: a cancellation sweep of %d open requests took %.2f s; the next in %.2f s", self.name,
                             len(self._active), ended - started, pacer.next_at - ended)

    def _close(self, state: RequestState) -> None:
        state.done = True
        with self._lock:
            self._active.pop(state.rid, None)
            if state.group is not None and not all(s.done for s in state.group.states):
                return   # the abort token stays valid while a choice runs
            self._tokens.finish(state.abort_token, state.triton_id)

    def _cancel(self, state: RequestState) -> None:
        self.loop.abort(state.rid)
        self._close(state)
        self._count_final(state, FinishReason.CANCELLED)
        try:
            state.sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:
            pass

    def _sweep_cancelled(self) -> None:
        with self._lock:
            states = list(self._active.values())
        if states and not self.loop.alive:   # never leave a client waiting on a dead engine
            for state in states:
                self._close(state)
                self._count_final(state, FinishReason.ERROR)
                self._send_error(state.sender, self.life.dead_message(), self.pb.TritonError.UNAVAILABLE)
            return
        for state in states:
            if not state.done and state.sender.is_cancelled():
                log.info("%s: request %s cancelled by the client", self.name, state.rid)
                self._cancel(state)

    def _handle(self, state: RequestState, out) -> None:
        if state.done:
            return
        pb = self.pb
        # No is_cancelled() per token: it is a round trip to the server process, and per token it was the
        # largest cost of serving a token after the send itself. The sweep checks every open request each
        # CANCEL_SWEEP_S, and a send to a client that is gone fails (the respond loop then aborts the request).
        now = time.perf_counter()
        if out.new_token_ids:
            first = state.last_token_at is None
            self.metrics.record(generation_tokens=len(out.new_token_ids),
                                ttft=now - state.arrival if first else None,
                                itl=None if first else now - state.last_token_at)
            state.last_token_at = now
            state.generated += len(out.new_token_ids)
        if out.error is not None or out.finish_reason == FinishReason.ERROR:
            self._close(state)
            self._count_final(state, FinishReason.ERROR)
            self._send_error(state.sender, out.error or "request failed", pb.TritonError.INTERNAL)
            return
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if out.finished else 0
        if out.finished:
            self._close(state)
            self._count_final(state, out.finish_reason or FinishReason.STOP)
        arrays = state.response_arrays(out, self.engine.tokenizer)
        if arrays is not None:
            self._send(state, arrays, final)

    def _send(self, state: RequestState, arrays: dict, flags: int) -> None:
        pb = self.pb
        if state.group is not None:
            arrays = {**arrays, "sequence_index": np.array([state.index], dtype=np.int32)}
        if self.batched:   # max_batch_size 1: every output has the batch dimension first
            arrays = {name: arr[np.newaxis] for name, arr in arrays.items()}
        tensors = [pb.Tensor(name, arr) for name, arr in arrays.items()]
        state.sender.send(pb.InferenceResponse(output_tensors=tensors), flags=flags)
