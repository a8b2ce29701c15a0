"""The Triton Python-backend model of an LLM (decoupled): thin glue between Triton and the engine.

execute() validates each request and hands it to the EngineLoop; a response thread of its own
turns engine outputs into Triton responses (never the decode loop), checks cancellation on every
output and in a periodic sweep, and aborts cancelled requests in the engine, which frees their
pages at once.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from ..config import EngineConfig
from ..sampling.params import RequestError
from .request import ParsedRequest, parse_request
from .responses import output_arrays

log = logging.getLogger("backend_lib.triton")
INPUT_NAMES = ("text_input", "input_ids", "stream", "sampling_parameters", "max_tokens", "min_tokens", "top_k",
               "beam_width", "temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
               "seed", "stop_words", "exclude_input_in_output", "return_finish_reason", "return_num_input_tokens",
               "return_num_output_tokens", "return_logprobs")
CANCEL_SWEEP_S = 0.1
GAUGE_PERIOD_S = 0.1


class Overloaded(Exception):
    """The waiting queue is full: refuse at once rather than queue without bound."""


@dataclass
class RequestState:
    rid: str
    sender: object
    req: ParsedRequest
    prompt_ids: list[int]
    arrival: float
    last_token_at: float | None = None
    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    done: bool = False


def _setup_logging() -> None:
    root = logging.getLogger("backend_lib")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("QWEN3_LOG_LEVEL", "INFO"))
        root.propagate = False


def engine_config_from_args(args: dict) -> EngineConfig:
    """EngineConfig from config.pbtxt parameters, env overrides and the instance kind/device."""
    model_config = json.loads(args["model_config"])
    name = args["model_name"]
    params = {k: v.get("string_value", "") for k, v in (model_config.get("parameters") or {}).items()}
    for key in sorted(EngineConfig.field_names()):   # $<MODEL>_<PARAMETER> overrides config.pbtxt
        env = os.environ.get(f"{name.upper()}_{key.upper()}")
        if env:
            params[key] = env
            log.info("%s: %s from $%s_%s = %s", name, key, name.upper(), key.upper(), env)
    kind = args.get("model_instance_kind", "CPU")
    device_id = args.get("model_instance_device_id", "0")
    if kind == "GPU":
        base = params.get("device", "cuda")
        params["device"] = f"{'npu' if base.startswith('npu') else 'cuda'}:{device_id}"
    elif kind == "CPU" and params.get("device", "cpu") in ("", "auto"):
        params["device"] = "cpu"
    params.setdefault("device", "cpu")
    return EngineConfig.from_params(params, base_dir=args["model_repository"])


class TritonLLMModel:
    def initialize(self, args):
        import triton_python_backend_utils as pb_utils

        from ..engine import EngineLoop, LLMEngine
        from .metrics import EngineMetrics

        _setup_logging()
        self.pb = pb_utils
        self.name = args["model_name"]
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException(f"{self.name}: model_transaction_policy.decoupled must be true")
        cfg = engine_config_from_args(args)
        log.info("%s: loading %s on %s (%s KV cache)", self.name, cfg.checkpoint, cfg.device, cfg.kv_cache)
        # Built in the engine thread: one OpenMP team in the process (see EngineLoop.build).
        self.loop = EngineLoop.build(lambda: LLMEngine(cfg), name=f"{self.name}-engine")
        self.engine = self.loop.engine
        self.metrics = EngineMetrics(pb_utils, {"model": self.name, "version": args.get("model_version", "1")})
        self._queue: queue.Queue = queue.Queue()
        self._active: dict[str, RequestState] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._respond_loop, name=f"{self.name}-responses", daemon=True)
        self._thread.start()
        log.info("%s: ready", self.name)

    # ----- Triton entry points ---------------------------------------------------------------------
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._submit(request, sender)
            except RequestError as exc:
                self._send_error(sender, str(exc), self.pb.TritonError.INVALID_ARG)
            except Overloaded as exc:
                self._send_error(sender, str(exc), self.pb.TritonError.UNAVAILABLE)
            except Exception as exc:
                log.exception("%s: request failed before reaching the engine", self.name)
                self._send_error(sender, f"internal error: {exc}", self.pb.TritonError.INTERNAL)
        return None

    def finalize(self):
        log.info("%s: finalizing", self.name)
        self.loop.shutdown()
        self._stop.set()
        self._thread.join(timeout=10)

    # ----- requests --------------------------------------------------------------------------------
    def _submit(self, request, sender) -> None:
        pb = self.pb

        def get(name):
            t = pb.get_input_tensor_by_name(request, name)
            return None if t is None else t.as_numpy()

        req = parse_request(get, request.parameters(), self.engine.cfg.limits.max_prompt_bytes)
        waiting = len(self.engine.scheduler.waiting) + self.loop.num_pending()
        if waiting >= self.engine.cfg.max_waiting_requests:
            raise Overloaded(f"server overloaded (UNAVAILABLE): {waiting} requests are waiting "
                             f"(max_waiting_requests {self.engine.cfg.max_waiting_requests}); retry later")
        tok = self.engine.tokenizer
        prompt_ids = req.input_ids if req.input_ids is not None else tok.encode(req.text)
        params = self.engine.make_params(req.sampling)
        rid = f"{self.name}-{uuid.uuid4().hex}"
        state = RequestState(rid, sender, req, prompt_ids, time.perf_counter())
        with self._lock:
            self._active[rid] = state
        try:
            self.loop.submit(rid, prompt_ids, params, lambda out, s=state: self._queue.put((s, out)))
        except Exception:
            with self._lock:
                self._active.pop(rid, None)
            raise
        self.metrics.prompt_tokens.increment(len(prompt_ids))

    def _send_error(self, sender, message: str, code) -> None:
        err = self.pb.TritonError(message, code)
        sender.send(self.pb.InferenceResponse(output_tensors=[], error=err),
                    flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    # ----- response thread -------------------------------------------------------------------------
    def _respond_loop(self) -> None:
        last_sweep = last_gauges = 0.0
        while not (self._stop.is_set() and self._queue.empty()):
            try:
                state, out = self._queue.get(timeout=CANCEL_SWEEP_S)
                try:
                    self._handle(state, out)
                except Exception:   # e.g. the client is gone: stop generating for it
                    log.exception("%s: sending a response failed; aborting %s", self.name, state.rid)
                    if not out.finished:
                        self.loop.abort(state.rid)
                    self._close(state)
            except queue.Empty:
                pass
            now = time.perf_counter()
            try:
                if now - last_sweep >= CANCEL_SWEEP_S:
                    last_sweep = now
                    self._sweep_cancelled()
                if now - last_gauges >= GAUGE_PERIOD_S:
                    last_gauges = now
                    self._update_gauges()
            except Exception:
                log.exception("%s: cancellation sweep or metrics update failed", self.name)

    def _update_gauges(self) -> None:
        sched = self.engine.scheduler
        bm = self.engine.block_manager
        self.metrics.update_gauges(len(sched.running), len(sched.waiting) + self.loop.num_pending(), bm.num_used,
                                   bm.num_pages)

    def _close(self, state: RequestState) -> None:
        state.done = True
        with self._lock:
            self._active.pop(state.rid, None)

    def _cancel(self, state: RequestState) -> None:
        self.loop.abort(state.rid)
        self._close(state)
        self.metrics.finished("cancelled")
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
                self._send_error(state.sender, "engine stopped (UNAVAILABLE)", self.pb.TritonError.UNAVAILABLE)
            return
        for state in states:
            if not state.done and state.sender.is_cancelled():
                log.info("%s: request %s cancelled by the client", self.name, state.rid)
                self._cancel(state)

    def _handle(self, state: RequestState, out) -> None:
        if state.done:
            return
        pb = self.pb
        if state.sender.is_cancelled():
            self._cancel(state)
            return
        now = time.perf_counter()
        if out.new_token_ids:
            if state.last_token_at is None:
                self.metrics.ttft.observe(now - state.arrival)
            else:
                self.metrics.itl.observe(now - state.last_token_at)
            state.last_token_at = now
            self.metrics.generation_tokens.increment(len(out.new_token_ids))
        if out.error is not None or out.finish_reason == "error":
            self._close(state)
            self.metrics.finished("error")
            self._send_error(state.sender, out.error or "request failed", pb.TritonError.INTERNAL)
            return
        req = state.req
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if out.finished else 0
        if req.stream:
            arrays = output_arrays(out.new_text, out.new_token_ids, finish_reason=out.finish_reason,
                                   num_input_tokens=out.num_prompt_tokens, num_output_tokens=out.num_output_tokens,
                                   cumulative_logprob=out.cumulative_logprob, logprobs=out.new_logprobs, flags=req)
            self._send(state, arrays, final)
        else:
            state.text.append(out.new_text)
            state.ids.extend(out.new_token_ids)
            if out.new_logprobs:
                state.logprobs.extend(out.new_logprobs)
            if out.finished:
                text = "".join(state.text)
                if not req.exclude_input_in_output:
                    prefix = req.text if req.input_ids is None else self.engine.tokenizer.decode(
                        state.prompt_ids, skip_special_tokens=False)
                    text = prefix + text
                arrays = output_arrays(text, state.ids, finish_reason=out.finish_reason,
                                       num_input_tokens=out.num_prompt_tokens, num_output_tokens=out.num_output_tokens,
                                       cumulative_logprob=out.cumulative_logprob,
                                       logprobs=state.logprobs if req.return_logprobs or state.logprobs else None,
                                       flags=req)
                self._send(state, arrays, final)
        if out.finished:
            self._close(state)
            self.metrics.finished(out.finish_reason or "stop")

    def _send(self, state: RequestState, arrays: dict, flags: int) -> None:
        pb = self.pb
        tensors = [pb.Tensor(name, arr) for name, arr in arrays.items()]
        state.sender.send(pb.InferenceResponse(output_tensors=tensors), flags=flags)
