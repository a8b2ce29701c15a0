"""The engine: loads a checkpoint, admits requests, steps the batch and emits per-request deltas.

Single-threaded by design (EngineLoop drives it from its own thread). Every request gets its
output in RequestOutput deltas; a fault inside a step turns into error outputs for the requests
of that step, whose pages are freed, and the engine carries on.
"""
from __future__ import annotations

import itertools
import logging
import time

import torch

from ..checkpoint import ModelConfig, WeightStore, parse_quantization_config
from ..config import EngineConfig, fault_every
from ..device import parse_dtype, resolve_device
from ..kernels import get_kernels
from ..kv_cache import BlockManager, allocate_kv_cache
from ..models import Qwen3ForCausalLM
from ..sampling.params import RequestError, SamplingParams
from ..tokenizer import Tokenizer
from .model_runner import ModelRunner
from .outputs import RequestOutput
from .scheduler import Scheduler
from .sequence import Sequence, SequenceStatus

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, cfg: EngineConfig):
        cfg.validate()
        self.cfg = cfg
        t0 = time.time()
        self.device = resolve_device(cfg.device)
        self.dtype = parse_dtype(cfg.dtype, self.device)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.model_config = ModelConfig.from_dir(cfg.checkpoint)
        mc = self.model_config
        scheme = parse_quantization_config(mc.quantization_config)
        self.quantization = scheme.kind if scheme else None
        self.tokenizer = Tokenizer(cfg.tokenizer or cfg.checkpoint)
        self.max_model_len = cfg.max_model_len or min(mc.max_position_embeddings, 8192)
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len: {self.max_model_len} exceeds the checkpoint's "
                             f"max_position_embeddings {mc.max_position_embeddings}")
        if cfg.max_num_batched_tokens < cfg.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({cfg.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({cfg.max_num_seqs}) so every running sequence can decode each step")
        self.kernels = get_kernels(self.device, cfg.kernels, cfg.kernel_cache_dir)
        log.info("device %s, dtype %s, kernels %s, %d threads", self.device, self.dtype, self.kernels.name,
                 torch.get_num_threads())
        self.model = Qwen3ForCausalLM.from_checkpoint(WeightStore(cfg.checkpoint), mc, scheme, self.dtype,
                                                      self.device, self.kernels, self.max_model_len)
        cache_kwargs = {"seed": cfg.tq_seed} if cfg.kv_cache == "tq" else {}
        self.kv_cache = allocate_kv_cache(cfg.kv_cache, mc, self.dtype, self.device, self.kernels,
                                          cfg.kv_cache_memory, cfg.page_size, self.max_model_len, cfg.max_num_seqs,
                                          **cache_kwargs)
        self.block_manager = BlockManager(self.kv_cache.num_pages, cfg.page_size)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.kv_cache, cfg.page_size, self.device,
                                  fault_every(cfg.fault_injection) if cfg.fault_injection else None)
        self.num_failed_steps = 0
        self.end_ids = set(self.tokenizer.end_token_ids) | set(mc.eos_token_ids)
        self.vocab_size = mc.vocab_size
        self._seqs: dict[str, Sequence] = {}
        self._arrival = itertools.count()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        log.info("engine ready in %.1fs: max_model_len %d, max_num_seqs %d, %d KV pages of %d", time.time() - t0,
                 self.max_model_len, cfg.max_num_seqs, self.kv_cache.num_pages, cfg.page_size)

    # ----- requests -------------------------------------------------------------------------------
    def make_params(self, data: dict | None = None) -> SamplingParams:
        """SamplingParams from vLLM-named fields over the checkpoint's generation_config defaults."""
        params = SamplingParams.from_dict(data or {}, self.model_config.generation_defaults)
        return params.validate(self.cfg.limits, self.vocab_size)

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Validates a request without admitting it; returns its resolved max_tokens."""
        if not prompt_ids:
            raise RequestError("prompt is empty: send a non-empty text_input or input_ids")
        if any((not isinstance(t, int)) or t < 0 or t >= self.vocab_size for t in prompt_ids):
            bad = next(t for t in prompt_ids if not isinstance(t, int) or t < 0 or t >= self.vocab_size)
            raise RequestError(f"input_ids: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len} "
                               "(prompt plus at least one generated token must fit)")
        room = self.max_model_len - len(prompt_ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.cfg.default_max_tokens
        return min(max_tokens, room)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._seqs:
            raise RequestError(f"request id {request_id!r} is already running")
        max_tokens = self.check_request(prompt_ids, params)
        seq = Sequence(request_id, prompt_ids, params, max_tokens, self.end_ids,
                       self.tokenizer.detokenizer(params.skip_special_tokens), next(self._arrival))
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        self.num_prompt_tokens += len(prompt_ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.remove(seq)
        seq.finish_reason = "cancelled"
        return self._output(seq, [], "", None)

    def abort_all(self, reason: str = "cancelled", error: str | None = None) -> list[RequestOutput]:
        outs = []
        for rid in list(self._seqs):
            seq = self._seqs.pop(rid)
            self.scheduler.remove(seq)
            seq.finish_reason = reason
            outs.append(self._output(seq, [], "", None, error=error))
        return outs

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    # ----- stepping --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if not plan:
            if self.scheduler.waiting and not self.scheduler.running:
                # Nothing fits even into an empty pool: cannot happen with a validated pool, but never spin.
                return self.abort_all("error", "KV cache too small for the waiting request")
            return []
        try:
            samples = self.runner.execute(plan)
        except Exception as exc:  # a fault in the forward: fail this step's requests, keep serving
            self.num_failed_steps += 1
            log.exception("engine step failed; failing %d request(s)", len(plan))
            outs = []
            for seq, _ in plan:
                if self._seqs.pop(seq.request_id, None) is not None:
                    self.scheduler.remove(seq)
                    seq.finish_reason = "error"
                    outs.append(self._output(seq, [], "", None, error=f"engine step failed: {exc}"))
            return outs
        for seq, n in plan:
            seq.num_computed += n
        return [self._append(seq, sample) for seq, sample in samples]

    def _append(self, seq: Sequence, sample) -> RequestOutput:
        tok = sample.token_id
        seq.append(tok)
        self.num_generation_tokens += 1
        logprobs = None
        if sample.logprob is not None:
            seq.cumulative_logprob += sample.logprob
            logprobs = [{"id": tok, "logprob": sample.logprob,
                         "top": [{"id": i, "logprob": lp} for i, lp in sample.top_logprobs or []]}]
        n_out = len(seq.output_ids)
        reason = None
        text = ""
        if tok in seq.stop_ids:  # the sampler blocks these before min_tokens
            reason = "stop"
        else:
            delta = seq.detokenizer.add(tok)
            text = seq.stop_matcher.feed(delta) if n_out > seq.params.min_tokens else delta
            if seq.stop_matcher.stopped_on is not None:
                reason = "stop"
        if reason is None and (n_out >= seq.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            if seq.stop_matcher.stopped_on is None:
                text += seq.stop_matcher.feed(seq.detokenizer.flush()) + seq.stop_matcher.flush()
            seq.finish_reason = reason
            self._seqs.pop(seq.request_id, None)
            self.scheduler.remove(seq)
        return self._output(seq, [tok], text, logprobs)

    def _output(self, seq: Sequence, ids, text, logprobs, error: str | None = None) -> RequestOutput:
        finished = seq.finish_reason is not None
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=list(ids), new_text=text, finished=finished,
            finish_reason=seq.finish_reason, num_prompt_tokens=len(seq.prompt_ids),
            num_output_tokens=len(seq.output_ids), new_logprobs=logprobs,
            cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None, error=error)

    # ----- offline helpers -------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[dict]:
        """Runs prompts to completion together (continuous batching); returns ids, text, finish reason."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        results = {}
        for i, (ids, p) in enumerate(zip(prompts, plist)):
            rid = f"offline-{i}-{next(self._arrival)}"
            self.add_request(rid, ids, p)
            results[rid] = {"output_ids": [], "text": "", "finish_reason": None}
        while any(r["finish_reason"] is None for r in results.values()):
            for out in self.step():
                r = results.get(out.request_id)
                if r is None:
                    continue
                r["output_ids"] += out.new_token_ids
                r["text"] += out.new_text
                if out.finished:
                    r["finish_reason"] = out.finish_reason
        return list(results.values())

    def score(self, token_ids: list[int]) -> list[float | None]:
        """Log-probability of each token given those before it; the first entry is None."""
        return self.score_detail(token_ids)[0]

    def score_detail(self, token_ids: list[int]) -> tuple[list[float | None], list[int]]:
        """(score(token_ids), the top-1 prediction after each position)."""
        if len(token_ids) > self.max_model_len:
            raise RequestError(f"ids: {len(token_ids)} tokens exceed max_model_len {self.max_model_len}")
        seq = Sequence("score", token_ids, SamplingParams(), 1, set(), self.tokenizer.detokenizer(), -1)
        try:
            self.block_manager.grow(seq.block_table, len(token_ids))
            return self.runner.prompt_logprobs(seq, self.cfg.max_num_batched_tokens)
        finally:
            self.block_manager.free(seq.block_table)
