"""The device side of the engine: builds and owns the model, the KV cache and the sampler; turns a
scheduled step (a StepPlan) into tensors, copies the pages the scheduler asked for, runs the model and samples
the sequences that reached their end. It returns tensors and samples (a StepResult); the output processor turns
them into what the API sends, the scheduler into the next step's state."""
from __future__ import annotations

import logging

import torch

from ..checkpoint import WeightStore
from ..kv_cache import allocate_kv_cache
from ..kv_cache.metadata import AttentionMetadata
from ..models import Qwen3ForCausalLM
from ..layers.greedy_head import ScreenedHead
from ..sampling.sampler import Sample, Sampler, plain_greedy
from ..spec.decoder import SpecDecoder
from .cuda_graphs import DecodeGraphs, VerifyGraphs, step_rows
from .sequence import Sequence
from .step import PromptLogprobs, StepPlan, StepResult
from .warmup import CudaMemory, kv_budget_after_warmup, warm_up

log = logging.getLogger(__name__)


def greedy_head_of(cfg, kernels) -> str:
    """EngineConfig.greedy_head resolved for a kernel set: auto is the int8 screen on the CPU set (whose
    float_linear_rows reads only the candidates' rows) with the checkpoint's head, else off."""
    if cfg.greedy_head == "auto":
        return "int8" if kernels.name == "cpu" and cfg.lm_head_quant == "checkpoint" else "off"
    return cfg.greedy_head


class InjectedFault(RuntimeError):
    """Raised by the fault-injection test hook."""


class ModelRunner:
    def __init__(self, cfg, model_config, scheme, device: torch.device, dtype: torch.dtype, kernels,
                 max_model_len: int, fault_every: int | None = None, memory=None):
        self.device, self.page_size = device, cfg.page_size
        self.tp = None    # tensor parallel: the workers' supervisor (backend_lib/parallel/runtime.py)
        if cfg.tensor_parallel_size > 1:   # the sharded model and KV cache, whose steps reach every rank
            from ..parallel import runtime

            self.model, self.kv_cache, self.tp = runtime.start(cfg, model_config, scheme, device, dtype, kernels,
                                                               max_model_len)
        else:
            self.model = Qwen3ForCausalLM.from_checkpoint(WeightStore(cfg.checkpoint), model_config, scheme, dtype,
                                                          device, kernels, max_model_len, cfg.lm_head_quant,
                                                          greedy_head_of(cfg, kernels), cfg.moe_experts_quant,
                                                          cfg.int4_activations)
            # CUDA: the widest prefill and decode run first, then the pool is sized from what is free (warmup.py)
            memory = memory if memory is not None else (CudaMemory(device) if device.type == "cuda" else None)
            nbytes = None
            if memory is not None:
                activation = warm_up(self, cfg, model_config, dtype, kernels, max_model_len, memory)
                nbytes = kv_budget_after_warmup(cfg.kv_cache_memory, memory.free(), activation)
            self.kv_cache = allocate_kv_cache(cfg.kv_cache, model_config, dtype, device, kernels,
                                              cfg.kv_cache_memory, cfg.page_size, max_model_len, cfg.max_num_seqs,
                                              nbytes=nbytes, seed=cfg.tq_seed)
        # one pipeline wherever the logits are (off the CPU without a host sync: ids and logprobs travel back)
        self.sampler = Sampler(kernels.argmax_rows)
        self.lora_ctx = None
        if cfg.lora_enabled:   # LoRA: the fused linears wrapped (backend_lib/lora/layer.py)
            from ..lora.layer import LoraContext, attach

            self.lora_ctx = LoraContext()
            if self.tp is not None:   # each rank's shard of the adapters (parallel/lora.py)
                self.model.attach_lora(self.lora_ctx, kernels)
            else:
                attach(self.model, self.lora_ctx, kernels)
        # decode replayed from CUDA graphs: the Triton set only (its KV writes skip the padding rows); [spec] and
        # verification steps, k + 1 rows a sequence, an EAGLE-3 head's aux states included (engine/cuda_graphs.py)
        self.graphs = self.verify_graphs = None
        if cfg.cuda_graphs and device.type == "cuda" and kernels.name == "triton":
            max_pages = -(-max_model_len // cfg.page_size)
            self.graphs = DecodeGraphs(self, cfg.max_num_seqs, max_pages)
            if cfg.speculative is not None:
                self.verify_graphs = VerifyGraphs(self, cfg.max_num_seqs, max_pages,
                                                  cfg.speculative.num_speculative_tokens)
        self.fault_every = fault_every
        self.steps = 0
        self.aux_layers: tuple[int, ...] | None = None   # [spec] EAGLE-3: the layers its head reads (spec/eagle3.py)

    def prepare(self, plan: list[tuple[Sequence, int]]):
        if self.is_decode(plan):
            return self.prepare_decode(plan)
        S = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl, lens, tables, sample_rows, sample_seqs = [0], [], [], [], []
        for seq, n in plan:
            start = seq.num_computed
            i, p, s = step_rows(seq, n, S)   # [spec] a verifying sequence's drafts after its tokens
            ids.extend(i)
            positions.extend(p)
            slots.extend(s)
            qsl.append(qsl[-1] + n)
            lens.append(start + n)
            tables.append(seq.block_table)
            k = len(seq.spec_tokens)
            if start + n == seq.num_tokens + k:   # [spec] a verifying sequence samples its last k + 1 rows
                sample_rows.extend(range(qsl[-1] - 1 - k, qsl[-1]))
                sample_seqs.extend([seq] * (k + 1))
        width = max(len(t) for t in tables)
        block_tables = torch.zeros((len(tables), width), dtype=torch.int32)
        for b, t in enumerate(tables):
            block_tables[b, :len(t)] = torch.tensor(t, dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=block_tables.to(dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        )
        return (torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(positions, dtype=torch.int64, device=dev),
                meta, sample_rows, sample_seqs)

    @staticmethod
    def is_decode(plan: list[tuple[Sequence, int]]) -> bool:
        return all(n == 1 and seq.num_computed + 1 == seq.num_tokens for seq, n in plan)

    def decode_inputs(self, plan: list[tuple[Sequence, int]]):
        """A decode step's three small host-to-device copies: ids [B], block tables [B, W], cached lengths [B]. The
        tables are padded as lists and made one tensor (a tensor a sequence and a zero-filled one cost ~0.1 ms more
        a batch-1 step on the 2-core VMs)."""
        pages = [seq.block_table for seq, _ in plan]
        width = max(len(t) for t in pages)
        dev = self.device
        tables = torch.tensor([t + [0] * (width - len(t)) for t in pages], dtype=torch.int32, device=dev)
        ids = torch.tensor([seq.tokens[seq.num_computed] for seq, _ in plan], dtype=torch.int64, device=dev)
        context = torch.tensor([seq.num_computed for seq, _ in plan], dtype=torch.int32, device=dev)
        return ids, tables, context

    def prepare_decode(self, plan: list[tuple[Sequence, int]]):
        """A decode step: the rest of the metadata is derived on the device (AttentionMetadata.for_decode), or on
        the CPU from the host's lists (for_decode_host: the same integers, fewer ops)."""
        ids, tables, context = self.decode_inputs(plan)
        if self.device.type == "cpu":
            meta, positions = AttentionMetadata.for_decode_host([seq.block_table for seq, _ in plan],
                                                                [seq.num_computed for seq, _ in plan], tables,
                                                                self.page_size)
        else:
            meta, positions = AttentionMetadata.for_decode(tables, context, self.page_size)
        return ids, positions, meta, list(range(len(plan))), [seq for seq, _ in plan]

    def decode_logits(self, input_ids: torch.Tensor, block_tables: torch.Tensor,
                      context_lens: torch.Tensor) -> torch.Tensor:
        """The device side of a decode step, from device tensors only: fp32 logits [B, vocab]. Nothing here
        reads a device value on the host (tests/test_no_host_sync.py runs it under FakeTensorMode)."""
        meta, positions = AttentionMetadata.for_decode(block_tables, context_lens, self.page_size)
        return self.step_logits(input_ids, positions, meta)

    def step_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """fp32 logits [T, vocab] of every row of a step laid out on the device ([spec] the verification graphs'
        step): the base model's forward, no host read."""
        return self.model.logits(self.model(input_ids, positions, self.kv_cache, meta))

    def step_logits_aux(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                        aux_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """[spec] step_logits through forward_aux: (fp32 logits [T, vocab], the aux layers' states [T, width]), the
        same logits bits (the graphs' step of an EAGLE-3 engine), no host read."""
        hidden, aux = self.model.forward_aux(input_ids, positions, self.kv_cache, meta, aux_layers)
        return self.model.logits(hidden), aux

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Runs the step; a raise here is a fault of the whole forward. Sampling faults are per row."""
        for src, dst in plan.page_copies:   # partial prompt pages taken by copy (the scheduler's decision)
            self.kv_cache.copy_page(src, dst)
        self.steps += 1
        if self.fault_every and self.steps % self.fault_every == 0:
            raise InjectedFault(f"injected fault at step {self.steps} (fault_injection every:{self.fault_every})")
        steps = plan.seqs
        result = StepResult()
        # [spec] rows of sequences an EAGLE-3 head drafts for: their aux hidden states too (forward_aux: the C++
        # layer loop where it applies, else the Python loop; the graphs of an EAGLE-3 engine capture it, and give
        # it in every step: dropped here when no row wants it)
        aux = self.aux_layers is not None and any(self.wants_aux(seq) for seq, _ in steps)
        # a step with LoRA rows runs eagerly (the graphs hold the base model's forward only)
        base = not any(seq.lora for seq, _ in steps)
        if self.graphs is not None and base and self.is_decode(steps) \
                and self.graphs.fits(len(steps), max(len(seq.block_table) for seq, _ in steps)):
            seqs = [seq for seq, _ in steps]
            logits, states = self.graphs.run(*self.decode_inputs(steps))
            if aux:
                result.hidden = self._aux_rows(steps, states)
        elif self.verify_graphs is not None and base and self.verify_graphs.fits(steps):   # [spec]
            logits, seqs, states = self.verify_graphs.run(steps)
            if aux:
                result.hidden = self._aux_rows(steps, states)
        else:
            input_ids, positions, meta, rows, seqs = self.prepare(steps)
            hidden = self.forward(steps, input_ids, positions, meta, aux)
            if aux:
                hidden, states = hidden
                result.hidden = self._aux_rows(steps, states)
            result.prompt_logprobs = self._prompt_logprobs(steps, hidden)
            if not seqs:
                return result
            hidden_rows = self.sampled_rows(hidden, rows)
            if self.screened(seqs):   # plain-greedy rows ([spec] verification rows too): no whole head product
                picks = self.model.lm_head.greedy_picks(hidden_rows)
                if picks is not None:
                    plain, verify = SpecDecoder.split_picks([Sample(t) for t in picks], seqs)
                    result.samples = plain + verify
                    return result
            logits = self.model.logits(hidden_rows)
        # [spec] a verifying sequence's k + 1 rows go back unsampled, as (seq, VerifyRows) after the sampled rows
        # (the engine's acceptance samples them one by one, through sample() below)
        logits, seqs, verify = SpecDecoder.split_rows(logits, seqs)
        result.samples = (list(zip(seqs, self.sample(logits, seqs))) if seqs else []) + verify
        return result

    @staticmethod
    def sampled_rows(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """hidden's rows that are sampled. prepare lists them ascending and once each, so as many as hidden has are
        all of them, in order: hidden itself (a decode step's; the list's index op costs ~0.2 ms a batch-1 step on
        the 2-core VMs, its caches cold after the layers)."""
        return hidden if len(rows) == hidden.shape[0] else hidden[rows]

    def screened(self, seqs: list[Sequence]) -> bool:
        """Whether a step's sampled rows (a verifying sequence's k + 1 among them) are all plain greedy and the head
        screens them."""
        return isinstance(self.model.lm_head, ScreenedHead) and all(plain_greedy(s) for s in seqs)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]):
        """A step's rows sampled where they are (the one sampling path of decode rows and verification rows)."""
        return self.sampler(logits, seqs)

    def forward(self, plan: list[tuple[Sequence, int]], input_ids, positions, meta, aux: bool = False):
        """The model over a prepared step; with LoRA on, each row with its sequence's adapter. aux: ([spec]
        EAGLE-3) (hidden, the aux layers' states [T, 3 * hidden]), the same hidden bits."""
        def run():
            if aux:
                return self.model.forward_aux(input_ids, positions, self.kv_cache, meta, self.aux_layers)
            return self.model(input_ids, positions, self.kv_cache, meta)
        if self.lora_ctx is None:
            return run()
        from ..lora.layer import LoraBatch

        with self.lora_ctx.use(LoraBatch.of([seq.lora for seq, n in plan for _ in range(n)], self.device)):
            return run()

    @staticmethod
    def wants_aux(seq: Sequence) -> bool:
        """[spec] Whether an EAGLE-3 head drafts for seq (every row of it feeds the head's cache)."""
        return seq.params.speculative != "off" and seq.failure is None

    def _aux_rows(self, plan: list[tuple[Sequence, int]], states: torch.Tensor):
        out, off = [], 0
        for seq, n in plan:
            if self.wants_aux(seq):
                out.append((seq, seq.num_computed, states[off:off + n]))
            off += n
        return out

    def _prompt_logprobs(self, plan: list[tuple[Sequence, int]], hidden: torch.Tensor) -> list[tuple[Sequence, PromptLogprobs]]:
        """prompt_logprobs from this step's forward (no second pass): the logits of every row of a
        sequence's prompt chunk, computed over the chunk's rows as LLMEngine.score computes them, so the
        values are score's. A failure fails that request alone (its PromptLogprobs carries the error)."""
        out = []
        off = 0
        for seq, n in plan:
            rows, off = slice(off, off + n), off + n
            k = seq.params.prompt_logprobs
            if k is None or seq.failure is not None:
                continue
            start, num_prompt, done = seq.num_computed, len(seq.prompt_ids), len(seq.prompt_logprobs)
            if start + n < done or done >= num_prompt:   # recomputed after a preemption: recorded already
                continue
            try:
                logp = torch.log_softmax(self.model.logits(hidden[rows]).float(), dim=-1).cpu()
                # row i predicts prompt token start + i + 1; those from `done` on are new
                lo, hi = max(done, start + 1) - start - 1, min(num_prompt, start + n + 1) - start - 1
                picked = logp[lo:hi]
                ids = seq.prompt_ids[start + lo + 1:start + hi + 1]
                lp = picked.gather(1, torch.tensor(ids, dtype=torch.int64).unsqueeze(1))
                chunk = PromptLogprobs(start + lo + 1, ids, lp.squeeze(1), (picked > lp).sum(dim=-1) + 1)
                if k:
                    top = torch.topk(logp, k, dim=-1)
                    chunk.top_ids, chunk.top_logprobs = top.indices[lo:hi], top.values[lo:hi]
            except Exception as exc:
                chunk = PromptLogprobs(error=f"prompt_logprobs: computing them failed ({exc})")
            out.append((seq, chunk))
        return out

    @torch.inference_mode()
    def prompt_logprobs(self, seq: Sequence, chunk: int) -> tuple[list[float | None], list[int]]:
        """Log-probability of every token given those before it (first entry None), chunk by chunk,
        and the model's top-1 prediction after each position."""
        out: list[float | None] = [None]
        top1: list[int] = []
        while seq.num_pending > 0:
            n = min(chunk, seq.num_pending)
            input_ids, positions, meta, _, _ = self.prepare([(seq, n)])
            hidden = self.forward([(seq, n)], input_ids, positions, meta)
            logp = torch.log_softmax(self.model.logits(hidden).float(), dim=-1).cpu()
            start = seq.num_computed
            nxt = seq.tokens[start + 1:start + n + 1]
            out.extend(logp[i, t].item() for i, t in enumerate(nxt))
            top1.extend(logp.argmax(dim=-1).tolist())
            seq.num_computed += n
        return out, top1
