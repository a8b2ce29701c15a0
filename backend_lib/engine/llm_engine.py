"""The engine: glue between the scheduler, the model runner and the output processor.

Single-threaded by design (EngineLoop drives it from its own thread): only that thread touches the
scheduler, the block manager and the sequences; other threads read the EngineStats snapshot it
publishes after each step. Requests are validated once, by make_request (in the caller's thread,
reading only immutable configuration), and admitted by add_request. A fault is contained as
narrowly as it can be: a failed sampling or output step fails that request alone; a failed
forward fails the requests of that step; the engine carries on.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace

import torch

from .. import cpu_policy
from ..checkpoint import ModelConfig, parse_quantization_config
from ..config import EngineConfig, fault_every
from ..device import bind_device, parse_dtype, resolve_device, trim_host_memory
from ..kernels import get_kernels
from ..kv_cache import BlockManager
from ..kv_cache.pool import pool_token_capacity
from ..kv_cache.prefix import root_hash
from ..contract.errors import RequestError
from ..contract.fields import check_min_tokens
from ..contract.finish import FinishReason
from ..sampling.params import SamplingParams, bad_words_token_ids
from ..sampling.sampler import SampleError
from ..sampling.structured import GrammarCompiler
from ..spec.decoder import ProposerContext, SpecDecoder, VerifyRows, check_proposer, make_proposer
from ..tokenizer import Tokenizer
from .messages import EngineStats, Request
from .model_runner import ModelRunner
from .output_processor import OutputProcessor
from .outputs import RequestOutput
from .scheduler import Scheduler
from .sequence import Sequence

log = logging.getLogger(__name__)


def resolve_max_model_len(cfg: EngineConfig, mc: ModelConfig, dtype, device) -> int:
    """The configured max_model_len, or the checkpoint's positions capped by what the KV budget holds."""
    positions = mc.max_position_embeddings
    if cfg.max_model_len is not None:
        if cfg.max_model_len > positions:
            raise ValueError(f"max_model_len: {cfg.max_model_len} exceeds the checkpoint's "
                             f"max_position_embeddings {positions}")
        return cfg.max_model_len
    capacity = pool_token_capacity(cfg.kv_cache, mc, dtype, device, cfg.kv_cache_memory, cfg.page_size)
    if capacity < positions:
        log.info("max_model_len %d: the checkpoint's %d positions capped by kv_cache_memory", capacity, positions)
    return max(2, min(positions, capacity))


class LLMEngine:
    def __init__(self, cfg: EngineConfig):
        cfg.validate()
        self.cfg = cfg
        t0 = time.time()
        self.device = resolve_device(cfg.device)
        bind_device(self.device)       # LLMEngine is built in the engine thread (EngineLoop.build)
        self.dtype = parse_dtype(cfg.dtype, self.device)
        # the operator's cores / threads are fixed; otherwise the launcher's share, resized per step
        self.core_share = None
        if cfg.cpu_share and not (cfg.cpu_cores or cfg.num_threads):
            self.core_share = cpu_policy.CoreShare(cfg.cpu_share)
            cores = self.core_share.start()
        elif cfg.tensor_parallel_size > 1 and self.device.type == "cpu" and (cores := tp_bind(cfg)) is not None:
            pass    # rank 0 on its share of the host's cores (parallel/bind.py)
        else:
            cores, _ = cpu_policy.apply(cfg.cpu_cores, cfg.num_threads)
        self.model_config = mc = ModelConfig.from_dir(cfg.checkpoint)
        scheme = parse_quantization_config(mc.quantization_config)
        self.quantization = scheme.kind if scheme else None
        self.tokenizer = Tokenizer(cfg.tokenizer or cfg.checkpoint)
        self.max_model_len = resolve_max_model_len(cfg, mc, self.dtype, self.device)
        if cfg.max_num_batched_tokens < cfg.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({cfg.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({cfg.max_num_seqs}) so every running sequence can decode each step")
        if cfg.speculative is not None:   # [spec] a draft checked against the target before either is loaded
            check_proposer(cfg.speculative, mc, self.max_model_len)
        kernels = get_kernels(self.device, cfg.kernels, cfg.kernel_cache_dir)
        log.info("device %s, dtype %s, kernels %s, %d threads%s", self.device, self.dtype, kernels.name,
                 torch.get_num_threads(), f" on cores {cpu_policy.format_cores(cores)}" if cores else "")
        self.runner = ModelRunner(cfg, mc, scheme, self.device, self.dtype, kernels, self.max_model_len,
                                  fault_every(cfg.fault_injection) if cfg.fault_injection else None)
        self.lora = None     # the LoRA adapters it serves (backend_lib/lora), when LoRA is on
        if cfg.lora_enabled:
            from ..lora import BaseShape, LoraRegistry, parse_lora_modules

            self.lora = LoraRegistry(parse_lora_modules(cfg.lora_modules), BaseShape.of(mc), cfg.max_loras,
                                     cfg.max_lora_rank, kernels, self.device, cfg.allow_runtime_lora,
                                     roots=cfg.lora_roots, prepare=cfg.tensor_parallel_size == 1)
        self.block_manager = BlockManager(self.runner.kv_cache.num_pages, cfg.page_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   cfg.scheduling_policy, cfg.max_scoring_tokens_per_step)
        self.output = OutputProcessor(self.tokenizer, self.max_model_len)
        self.end_ids = set(self.tokenizer.end_token_ids) | set(mc.eos_token_ids)
        self.vocab_size = mc.vocab_size
        self.grammar = GrammarCompiler(self.tokenizer.hf, mc.vocab_size, sorted(self.end_ids),
                                       self.tokenizer.think_end_id)
        self._seqs: dict[str, Sequence] = {}
        self._offline_ids = itertools.count()
        # [spec] speculative decoding (backend_lib/spec), when the model's speculative_config asks for it
        self.spec = None
        if cfg.speculative is not None:
            ctx = ProposerContext(cfg, mc, self.device, self.dtype, kernels, self.max_model_len, self.runner)
            self.spec = SpecDecoder(cfg.speculative, self.max_model_len, make_proposer(cfg.speculative, ctx))
            self.scheduler.on_preempt = self.spec.free
        self.stats = EngineStats(pages_total=self.block_manager.num_pages)
        trim_host_memory()
        log.info("engine ready in %.1fs: max_model_len %d, max_num_seqs %d, %d KV pages of %d", time.time() - t0,
                 self.max_model_len, cfg.max_num_seqs, self.block_manager.num_pages, cfg.page_size)

    # ----- requests (make_params / make_request read only immutable configuration: any thread) -----
    def make_params(self, data: dict | None = None) -> SamplingParams:
        """SamplingParams from vLLM-named fields over the checkpoint's generation_config defaults."""
        params = SamplingParams.from_dict(data or {}, self.model_config.generation_defaults)
        return params.validate(self.cfg.limits, self.vocab_size)

    def make_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Request:
        """The one validation of a request: prompt ids, length, and max_tokens resolved."""
        if not prompt_ids:
            raise RequestError("prompt is empty: send a non-empty text_input or input_ids")
        for t in prompt_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise RequestError(f"input_ids: token id {t} is outside the vocabulary [0, {self.vocab_size})")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len} "
                               "(prompt plus at least one generated token must fit)")
        if params.priority and self.cfg.scheduling_policy != "priority":
            raise RequestError(f"priority: {params.priority} needs the model parameter scheduling_policy: priority "
                               "(this model schedules fcfs)")
        if params.prompt_logprobs is not None:   # bounded work: scoring costs prompt tokens x (top N + 1)
            cost, budget = len(prompt_ids) * (params.prompt_logprobs + 1), self.cfg.limits.max_prompt_scoring
            if cost > budget:
                raise RequestError(f"prompt_logprobs: scoring {len(prompt_ids)} prompt tokens with "
                                   f"{params.prompt_logprobs} alternatives each is {cost} entries, over this model's "
                                   f"budget of {budget} (max_prompt_scoring)")
        room = self.max_model_len - len(prompt_ids)
        if params.max_tokens is not None and params.max_tokens > room:   # as vLLM: an error, not a clamp
            raise RequestError(f"max_tokens: {params.max_tokens} exceeds the {room} tokens left in the context "
                               f"(max_model_len {self.max_model_len} minus the prompt's {len(prompt_ids)})")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.cfg.default_max_tokens
        check_min_tokens(params.min_tokens, max_tokens,
                         "" if params.max_tokens is not None else ", the default_max_tokens")
        lora = self.lora_adapter(params)
        if params.bad_words and not params.bad_words_ids:
            params.bad_words_ids = bad_words_token_ids(params.bad_words, self.tokenizer.encode)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammar.matcher(params.structured_outputs, self.tokenizer.thinking_open(prompt_ids))
        return Request(request_id, tuple(prompt_ids), params, min(max_tokens, self.max_model_len - len(prompt_ids)),
                       grammar, lora)

    def lora_adapter(self, params: SamplingParams):
        """The request's LoRA adapter (loaded if it is not resident), None for the base; RequestError naming
        lora_name / lora_path."""
        if params.lora_name is None:
            if params.lora_path is not None:
                raise RequestError("lora_path: needs lora_name (the name the adapter is served under)")
            return None
        if self.lora is None:
            raise RequestError(f"lora_name: {params.lora_name!r}: this model serves no LoRA adapters "
                               "(enable_lora is off)")
        return self.lora.get(params.lora_name, params.lora_path)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Validates and admits a request (offline use; EngineLoop validates in submit and admits here)."""
        self.admit(self.make_request(request_id, prompt_ids, params))

    def admit(self, request: Request) -> None:
        """Admits a request validated by make_request; nothing is checked again."""
        if request.request_id in self._seqs:
            raise RequestError(f"request id {request.request_id!r} is already running")
        seq = Sequence(request.request_id, list(request.prompt_ids), request.params, request.max_tokens,
                       self.end_ids, request.grammar)
        seq.lora = request.lora
        if self.block_manager.caching:
            seq.cache_root = root_hash(self.runner.kv_cache.content_key, request.params.cache_salt,
                                       None if request.lora is None else request.lora.digest)
        self._seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        self.output.add(seq)
        self.publish_stats(prompt_tokens=len(seq.prompt_ids))

    def abort(self, request_id: str, reason: str = FinishReason.CANCELLED) -> RequestOutput | None:
        seq = self._seqs.get(request_id)
        return None if seq is None else self._finish(seq, reason)

    def abort_all(self, reason: str = FinishReason.CANCELLED, error: str | None = None) -> list[RequestOutput]:
        return [self._finish(seq, reason, error) for seq in list(self._seqs.values())]

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    # ----- stepping --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.core_share is not None:
            self.core_share.before_step()
        t0 = time.perf_counter()
        if self.spec is not None:   # [spec] drafts for the decoding sequences, granted by the scheduler
            self.spec.propose(self.scheduler.running)
        plan = self.scheduler.next_step()
        if not plan:
            if self.scheduler.waiting and not self.scheduler.running:
                # Nothing fits even into an empty pool: cannot happen with a validated pool, but never spin.
                return self.abort_all("error", "KV cache too small for the waiting request")
            return []
        # [spec] a step of decodes only (each sequence its one row and its granted drafts, read before the commit
        # clears them): the batch gate measures it
        decode_only = self.spec is not None and all(n == 1 + len(seq.spec_tokens) for seq, n in plan.seqs)
        try:
            result = self.runner.execute(plan)
        except Exception as exc:  # a fault in the forward: fail this step's requests, keep serving
            self.scheduler.update(plan, None)
            self.publish_stats(num_failed_steps=1)
            log.exception("engine step failed; failing %d request(s)", len(plan.seqs))
            failed = [self._finish(seq, "error", f"engine step failed: {exc}") for seq, _ in plan.seqs]
            if getattr(exc, "fatal", False):   # the engine cannot step again (a tensor-parallel rank is gone)
                exc.outputs = failed
                raise
            return failed
        self.scheduler.update(plan, result)
        for seq, start, rows in result.hidden:   # [spec] an EAGLE-3 head's inputs (the runner captures them)
            self.spec.observe(seq, start, rows)
        for seq, chunk in result.prompt_logprobs:
            try:
                self.output.record_prompt_logprobs(seq, chunk)
            except Exception as exc:   # this request's prompt_logprobs broke: it fails alone
                seq.failure = f"prompt_logprobs: recording them failed ({exc})"
        outputs = []
        for seq, _ in plan.seqs:
            if seq.failure is not None and seq.finish_reason is None:
                log.warning("request %s failed: %s", seq.request_id, seq.failure)
                outputs.append(self._finish(seq, "error", seq.failure))
        for seq, sample in result.samples:
            if seq.finish_reason is not None:   # failed above
                continue
            if isinstance(sample, VerifyRows):   # [spec] the accepted run, one output per token, then the commit
                outs, accepted = self.spec.verify(seq, sample, self._sample_one, self._process)
                outputs.extend(outs)
                if seq.finish_reason is None:
                    self.spec.commit(seq, accepted, self.block_manager)
                    self.scheduler.cache_full_pages(seq)
                continue
            outputs.append(self._process(seq, sample))
        tokens = sum(len(o.new_token_ids) for o in outputs)
        if self.spec is not None:
            self.spec.step_done(decode_only, tokens, time.perf_counter() - t0)
        self.publish_stats(generation_tokens=tokens)
        return outputs

    def _process(self, seq: Sequence, sample) -> RequestOutput:
        """One sampled token (or a SampleError) of seq through the output processor; a failure fails seq alone."""
        if isinstance(sample, SampleError):
            log.warning("request %s failed in sampling: %s", seq.request_id, sample.message)
            return self._finish(seq, "error", sample.message)
        try:
            out = self.output.process(seq, sample)
        except RequestError as exc:   # its grammar failed past admission: the error names the field
            log.warning("request %s failed: %s", seq.request_id, exc)
            return self._finish(seq, "error", str(exc))
        except Exception as exc:  # this request's text state broke: fail it alone
            log.exception("output processing of request %s failed", seq.request_id)
            return self._finish(seq, "error", f"output processing failed: {exc}")
        if out.finished:
            self._release(seq)
        return out

    def _sample_one(self, logits: torch.Tensor, seq: Sequence):
        """[spec] One verification row sampled as a decode step samples it (the runner's sampling path)."""
        try:
            return self.runner.sample(logits, [seq])[0]
        except Exception as exc:   # as the runner's sampling faults: this request alone
            return SampleError(f"sampling failed ({exc})")

    def idle(self) -> None:
        """Nothing left to compute (the engine thread is about to wait): the models sharing the cores may take
        this engine's at their next step."""
        if self.core_share is not None:
            self.core_share.idle()

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> RequestOutput:
        out = self.output.finish(seq, reason, error)
        self._release(seq)
        return out

    def _release(self, seq: Sequence) -> None:
        self._seqs.pop(seq.request_id, None)
        self.scheduler.remove(seq)
        if self.spec is not None:   # [spec] what its proposer holds for it (a draft model's pages)
            self.spec.free(seq)

    def publish_stats(self, **increments) -> None:
        """Publishes a new stats snapshot (an immutable object: readers in other threads see whole ones)."""
        s = self.stats
        sched, bm = self.scheduler, self.block_manager
        self.stats = replace(s, running=len(sched.running), waiting=len(sched.waiting), pages_used=bm.num_used,
                             pages_cached=bm.num_cached, num_preemptions=sched.num_preemptions,
                             prefix_cache_queries=sched.prefix_queries, prefix_cache_hits=sched.prefix_hits,
                             **self._lora_stats(), **(self.spec.stats() if self.spec is not None else {}),
                             **{k: getattr(s, k) + v for k, v in increments.items()})

    def _lora_stats(self) -> dict:
        if self.lora is None:
            return {}
        names = lambda seqs: tuple(sorted({q.lora.name for q in seqs if q.lora is not None}))  # noqa: E731
        return {"lora_running": names(self.scheduler.running), "lora_waiting": names(self.scheduler.waiting)}

    # ----- offline helpers -------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[dict]:
        """Runs prompts to completion together (continuous batching); returns ids, text, finish reason."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        results = {}
        for i, (ids, p) in enumerate(zip(prompts, plist)):
            rid = f"offline-{i}-{next(self._offline_ids)}"
            self.add_request(rid, ids, p)
            results[rid] = {"output_ids": [], "text": "", "finish_reason": None, "error": None}
        while any(r["finish_reason"] is None for r in results.values()):
            for out in self.step():
                r = results.get(out.request_id)
                if r is None:
                    continue
                r["output_ids"] += out.new_token_ids
                r["text"] += out.new_text
                if out.prompt_logprobs is not None:
                    r["prompt_logprobs"] = out.prompt_logprobs
                if out.finished:
                    r["finish_reason"], r["error"] = out.finish_reason, out.error
        return list(results.values())

    def score(self, token_ids: list[int], lora_name: str | None = None) -> list[float | None]:
        """Log-probability of each token given those before it; the first entry is None."""
        return self.score_detail(token_ids, lora_name)[0]

    def score_detail(self, token_ids: list[int], lora_name: str | None = None) -> tuple[list[float | None], list[int]]:
        """(score(token_ids), the top-1 prediction after each position); lora_name: with that adapter."""
        if len(token_ids) > self.max_model_len:
            raise RequestError(f"ids: {len(token_ids)} tokens exceed max_model_len {self.max_model_len}")
        seq = Sequence("score", token_ids, SamplingParams(), 1, set())
        seq.lora = self.lora_adapter(SamplingParams(lora_name=lora_name))
        with self.scheduler.scratch_pages(seq, len(token_ids)):
            return self.runner.prompt_logprobs(seq, self.cfg.max_num_batched_tokens)


def tp_bind(cfg):
    """Tensor parallel rank 0: binds the engine thread and its team to rank 0's share of the host's cores."""
    from ..parallel.bind import bind_rank, host_share

    return bind_rank(host_share(0, cfg.tensor_parallel_size), cfg.cpu_cores, cfg.num_threads)
