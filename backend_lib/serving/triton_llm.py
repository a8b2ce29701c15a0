"""The Triton Python-backend model of an LLM (decoupled): thin glue between Triton and the engine.

execute() validates each request and hands it to the EngineLoop; a response thread of its own
turns engine outputs into Triton responses (never the decode loop), checks cancellation in a
periodic sweep (not per output: is_cancelled() is a round trip to the server process), and aborts
cancelled requests in the engine, which frees their pages at once. The model reads engine state
only through the loop's stats snapshot.
"""
from __future__ import annotations

import hmac
import json
import os
import queue
import secrets
import signal
import threading
import time
import uuid
from collections import OrderedDict

import numpy as np
from dataclasses import dataclass, field


from ..sampling.params import RequestError
from .request import AbortRequest, ParsedRequest, parse_abort, parse_request
from .responses import abort_token_arrays, output_arrays
from .schema import LLM_INPUTS, LLM_OUTPUTS, declare
from .launcher import ENGINE_DEAD_ENV, STOP_FLAG_ENV, mark_load
from .log import get_logger, setup as setup_logging
from .metrics import FinishedRequest
from .triton_config import engine_config_from_args

log = get_logger()
CANCEL_SWEEP_S = 0.1
FINALIZE_TIMEOUT_S = 5.0
STOP_FLAG_POLL_S = 0.1
FINAL_METRICS_WAIT_S = 0.05
SIGTERM_GRACE_S = 3.0        # a model process that gets SIGTERM ends its streams, then exits after this at most
RECENT_TOKENS = 4096         # abort tokens of finished requests kept, so that a late abort is answered as valid


class Overloaded(Exception):
    """The waiting queue is full: refuse at once rather than queue without bound."""


class EngineDead(Exception):
    """The engine thread has died: every request is refused at once (UNAVAILABLE)."""


class _Choices:
    """The n choices of one Triton request (vLLM's n): one engine request each, one response stream. Each
    choice sends through its own _ChoiceSender; the Triton final flag goes out with the last choice's final
    response, and the first error ends the stream (the other choices are aborted, their sends dropped)."""

    def __init__(self, sender, n: int, final_flag: int, abort):
        self.sender, self.final_flag, self.abort = sender, final_flag, abort
        self.open = set(range(n))
        self.closed = False
        self.states: list = []

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()


class _ChoiceSender:
    def __init__(self, group: _Choices, index: int):
        self.group, self.index = group, index

    def is_cancelled(self) -> bool:
        return self.group.is_cancelled()

    def send(self, response=None, flags: int = 0) -> None:
        g = self.group
        if g.closed:
            return
        if response is not None and response.has_error():
            g.closed = True
            for s in g.states:
                if s.index != self.index and not s.done:
                    g.abort(s.rid)
            g.sender.send(response, flags=g.final_flag)
            return
        if flags & g.final_flag:
            g.open.discard(self.index)
            if g.open:
                flags &= ~g.final_flag
                if response is None:
                    return
            else:
                g.closed = True
        if response is None:
            g.sender.send(flags=flags)
        else:
            g.sender.send(response, flags=flags)


@dataclass
class RequestState:
    rid: str
    triton_id: str
    sender: object
    req: ParsedRequest
    prompt_ids: list[int]
    arrival: float
    abort_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    last_token_at: float | None = None
    generated: int = 0
    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    prompt_logprobs: list | None = None
    done: bool = False
    index: int = 0                        # the choice (n > 1)
    group: _Choices | None = None


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
                          # [spec] the spec_decode counters, when speculative decoding is on
                          self.engine.spec.cfg.num_speculative_tokens if self.engine.spec is not None else None),
            self.metrics,
            lambda: self.loop.stats, name=f"{self.name}-metrics")
        self._queue: queue.Queue = queue.Queue()
        self._active: dict[str, RequestState] = {}
        self._by_token: dict[str, RequestState] = {}     # the abort capability -> its request
        self._finished_tokens: OrderedDict[str, str] = OrderedDict()   # token -> Triton id, recent ones
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._exiting = False     # the server is shutting down (or this model unloading)
        self._dead = False        # the engine thread died (not a shutdown): see _engine_died
        self._thread = threading.Thread(target=self._respond_loop, name=f"{self.name}-responses", daemon=True)
        self._thread.start()
        self._sigterm = _SigtermPipe.install()
        self._watch = threading.Thread(target=self._watch_server, name=f"{self.name}-shutdown-watch", daemon=True)
        self._watch.start()
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
        self._drain()
        self._stop.set()
        self._thread.join(timeout=FINALIZE_TIMEOUT_S)
        self._watch.join(timeout=1.0)
        log.info("%s: finalized", self.name)

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
                _stderr(f"{self.name}: the server process exited; this model process exits too")
                os._exit(0)
            if sigterm_at is None and self._sigterm is not None and self._sigterm.received():
                # SIGTERM to this process (a supervisor that signals the whole group): end the open streams
                # at once, as on the stop flag, and exit unless the server finalizes this model first.
                sigterm_at = time.monotonic()
                _stderr(f"{self.name}: SIGTERM; aborting the requests in flight, exiting within "
                        f"{SIGTERM_GRACE_S:g} s")
                if not self._exiting:
                    threading.Thread(target=self._drain, daemon=True).start()
            if sigterm_at is not None and time.monotonic() - sigterm_at > SIGTERM_GRACE_S:
                os._exit(0)
            if flag and not self._exiting and os.path.exists(flag):
                log.info("%s: the server is stopping; aborting the requests in flight", self.name)
                self._drain()
            if not self._exiting and not self._dead and not self.loop.alive:
                self._engine_died()

    def _dead_message(self) -> str:
        return (f"{self.name}: the engine has stopped after a fault (UNAVAILABLE); the model cannot serve until "
                f"it is reloaded or the server restarts")

    def _engine_died(self) -> None:
        """The engine thread is gone (not a shutdown). Triton 2.51 gives a Python model no way to report itself
        not ready but unloading itself, which only --model-control-mode=explicit allows (as vllm_backend's
        health check does). So: every request from now on is refused at once (execute) and the open ones
        fail (the response thread's sweep); the model asks Triton to unload it; and it tells the project's
        launcher, through the file named by $QWEN3_ENGINE_DEAD, which stops the server so that its
        supervisor restarts it (launcher.supervise)."""
        self._dead = True
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

    def _drain(self) -> None:
        """No more calls into the server but response sends: the metrics thread stops, and the engine
        finishes every request in flight with finish_reason 'abort' (their final responses go out) and stops."""
        self._exiting = True
        self.publisher.stop()
        self.loop.shutdown(timeout=FINALIZE_TIMEOUT_S, reason="abort")

    # ----- requests --------------------------------------------------------------------------------
    def _submit(self, request, sender) -> None:
        if self._dead or (not self.loop.alive and not self._exiting):
            raise EngineDead(self._dead_message())
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
        choices = []
        for j in range(req.n):   # choice j of a seeded request: seed + j (vLLM's n > 1 children)
            sampling = dict(req.sampling)
            if j and sampling.get("seed") is not None:
                sampling["seed"] = (int(sampling["seed"]) + j) % 2**64
            choices.append((f"{self.name}-{uuid.uuid4().hex}", self.engine.make_params(sampling)))
        if req.n > 1:   # every choice valid before any runs (the loop validates again in submit)
            for rid, params in choices:
                self.engine.make_request(rid, prompt_ids, params)
        group = None
        if req.n > 1:
            group = _Choices(sender, req.n, self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL, self.loop.abort)
        arrival = time.perf_counter()
        states = []
        for j, (rid, _) in enumerate(choices):
            state = RequestState(rid, request.request_id(), sender if group is None else _ChoiceSender(group, j),
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
            self._by_token[first.abort_token] = first
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
        and no other. The answer for a token that matches no request is the same whether the id exists or
        not, so an abort reveals nothing about other clients' requests."""
        with self._lock:
            state = self._by_token.get(abort.token)
            finished = self._finished_tokens.get(abort.token)
        if state is not None and hmac.compare_digest(state.triton_id.encode(), abort.request_id.encode()):
            log.info("%s: request %s aborted by its client", self.name, state.rid)
            for s in (state.group.states if state.group is not None else [state]):
                self.loop.abort(s.rid, reason="abort")
        elif finished is None or not hmac.compare_digest(finished.encode(), abort.request_id.encode()):
            raise RequestError("abort_request_id: no running request matches this abort_request_id and abort_token "
                               "(an abort needs the abort_token of the request's first response: "
                               "return_abort_token)")
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
            if not self._exiting:
                self.publisher.flush(wait=FINAL_METRICS_WAIT_S)
        except Exception:
            log.exception("%s: counting request %s failed; its final response goes out all the same", self.name,
                          state.rid)

    # ----- response thread -------------------------------------------------------------------------
    def _respond_loop(self) -> None:
        last_sweep = 0.0
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
                        self._count_final(state, "cancelled")
            except queue.Empty:
                pass
            now = time.perf_counter()
            if now - last_sweep >= CANCEL_SWEEP_S and not self._exiting:
                last_sweep = now
                try:
                    self._sweep_cancelled()
                except Exception:
                    log.exception("%s: cancellation sweep failed", self.name)

    def _close(self, state: RequestState) -> None:
        state.done = True
        with self._lock:
            self._active.pop(state.rid, None)
            if state.group is not None and not all(s.done for s in state.group.states):
                return   # the abort token stays valid while a choice runs
            if self._by_token.pop(state.abort_token, None) is not None:
                self._finished_tokens[state.abort_token] = state.triton_id
                if len(self._finished_tokens) > RECENT_TOKENS:
                    self._finished_tokens.popitem(last=False)

    def _cancel(self, state: RequestState) -> None:
        self.loop.abort(state.rid)
        self._close(state)
        self._count_final(state, "cancelled")
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
                self._count_final(state, "error")
                self._send_error(state.sender, self._dead_message(), self.pb.TritonError.UNAVAILABLE)
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
        if out.error is not None or out.finish_reason == "error":
            self._close(state)
            self._count_final(state, "error")
            self._send_error(state.sender, out.error or "request failed", pb.TritonError.INTERNAL)
            return
        req = state.req
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if out.finished else 0
        if out.finished:
            self._close(state)
            self._count_final(state, out.finish_reason or "stop")
        if req.stream:
            arrays = output_arrays(out.new_text, out.new_token_ids, finish_reason=out.finish_reason,
                                   num_input_tokens=out.num_prompt_tokens, num_output_tokens=len(out.new_token_ids),
                                   token_text=self._token_text, num_cached_tokens=out.num_cached_tokens,
                                   cumulative_logprob=out.cumulative_logprob,
                                   logprobs=out.new_logprobs if req.logprobs_output else None, flags=req,
                                   prompt_logprobs=out.prompt_logprobs)
            self._send(state, arrays, final)
        else:
            state.text.append(out.new_text)
            state.ids.extend(out.new_token_ids)
            if out.new_logprobs:
                state.logprobs.extend(out.new_logprobs)
            if out.prompt_logprobs is not None:
                state.prompt_logprobs = out.prompt_logprobs
            if out.finished:
                text = "".join(state.text)
                if not req.exclude_input_in_output:
                    prefix = req.text if req.input_ids is None else self.engine.tokenizer.decode(
                        state.prompt_ids, skip_special_tokens=False)
                    text = prefix + text
                arrays = output_arrays(text, state.ids, finish_reason=out.finish_reason,
                                       num_input_tokens=out.num_prompt_tokens, num_output_tokens=len(state.ids),
                                       token_text=self._token_text, num_cached_tokens=out.num_cached_tokens,
                                       cumulative_logprob=out.cumulative_logprob,
                                       logprobs=state.logprobs if req.logprobs_output else None,
                                       flags=req, prompt_logprobs=state.prompt_logprobs)
                self._send(state, arrays, final)

    def _token_text(self, token_id: int) -> str:
        """A token's text for logprobs (decoded_token): its bytes as UTF-8, a partial character replaced."""
        table = self.engine.tokenizer.token_bytes
        return table[token_id].decode("utf-8", errors="replace") if 0 <= token_id < len(table) else ""

    def _send(self, state: RequestState, arrays: dict, flags: int) -> None:
        pb = self.pb
        if state.group is not None:
            arrays = {**arrays, "sequence_index": np.array([state.index], dtype=np.int32)}
        if self.batched:   # max_batch_size 1: every output has the batch dimension first
            arrays = {name: arr[np.newaxis] for name, arr in arrays.items()}
        tensors = [pb.Tensor(name, arr) for name, arr in arrays.items()]
        state.sender.send(pb.InferenceResponse(output_tensors=tensors), flags=flags)


def _stderr(message: str) -> None:
    """A log line that does not go through the server (for exit paths where the server may be gone)."""
    try:
        os.write(2, f"[{time.strftime('%H:%M:%S')}] backend_lib: {message}\n".encode(errors="replace"))
    except OSError:
        pass


class _SigtermPipe:
    """SIGTERM seen by a thread that is not the main one. The Python backend's stub ignores SIGTERM, and a
    Python-level handler runs only when the main thread executes Python (the stub's main thread waits in
    C++). But CPython's C-level handler also writes the signal number to the wakeup fd, from whatever
    thread the signal lands on; the watch thread reads that pipe."""

    def __init__(self, read_fd: int):
        self._fd = read_fd
        self._seen = False

    @classmethod
    def install(cls) -> "_SigtermPipe | None":
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
