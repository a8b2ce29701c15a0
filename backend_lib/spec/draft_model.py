"""The draft-model proposer (vLLM's `draft_model`): a smaller Qwen3 checkpoint with the target's vocabulary
proposes k tokens by greedy decoding, with its own model instance and its own paged KV cache.

It lives in the engine thread beside the target. Its KV pool has as many pages as the target's (dense, in
the engine's dtype; the draft's layers make it small) and its own BlockManager; each sequence holds a page
table there and `computed`, the number of its tokens (prompt + output so far) whose draft KV is in those
pages. Per engine step, for the speculating rows together:

  1. catch-up: one forward of every row's tokens the draft has not seen yet (the prompt on a row's first
     proposal, then the one or two tokens the last verification emitted past the accepted drafts), chunked
     to max_num_batched_tokens; its last row's argmax is draft 1;
  2. k - 1 decode forwards (one token per row still drafting): draft j fed at its position, draft j + 1 its
     argmax. Drafts 1 .. k - 1 thus have draft KV at positions L .. L + k - 2 (L = the row's tokens).

Rollback: the drafts fed are kept (`pending`); at commit (and, should no commit come, at the next proposal)
the leading run of them equal to the tokens the target emitted stays computed and the rest is dropped: those
positions are written again when next fed, and the pages past `computed` go back to the draft pool.
Preemption, abort and finish give back every draft page (`free`); the state stays on the sequence, so a
preempted one catches up again from its tokens (which a preemption never changes).

Prefix cache: with enable_prefix_caching, the draft pool caches full pages of committed tokens by content as
the target's does (the same hash chain over the tokens from a root of the draft's cache key and the request's
cache_salt; the draft runs without LoRA adapters, so no adapter in the root): a new request whose prompt
starts with cached draft pages takes them and catches up from there. Drafts never reach it.

Failures: a fault in a draft forward fails no request. The rows of that step get no drafts (they decode
plainly; nothing was committed, so the draft KV stays consistent) and the fault is logged. Verification is
exact whatever the drafts are (spec/decoder.py), so nothing a draft does changes any output.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from ..checkpoint import ModelConfig, WeightStore, parse_quantization_config
from ..kv_cache import BlockManager, allocate_kv_cache
from ..kv_cache.base import cache_class
from ..kv_cache.metadata import AttentionMetadata
from ..kv_cache.prefix import extend_hashes, root_hash

log = logging.getLogger(__name__)


@dataclass
class DraftState:
    """One sequence's draft KV: its pages in the draft pool and how many of its tokens they hold."""
    table: list[int] = field(default_factory=list)
    computed: int = 0            # seq.tokens[:computed] have draft KV
    pending: list[int] = field(default_factory=list)   # drafts fed at positions computed.. (not yet verified)
    root: bytes | None = None    # prefix caching: the root of this sequence's draft page hashes
    hashes: list[bytes] = field(default_factory=list)
    registered: int = 0          # pages of `table` recorded in the draft pool's prefix cache


def check_draft(path: str, target, max_model_len: int) -> ModelConfig:
    """The draft checkpoint's ModelConfig, checked against the target's (before anything is loaded); errors name
    speculative_config.model."""
    key = "speculative_config.model"
    try:
        mc = ModelConfig.from_dir(path)
    except Exception as exc:
        raise ValueError(f"{key}: {path!r}: {exc}") from None
    if mc.vocab_size != target.vocab_size:
        raise ValueError(f"{key}: the draft's vocabulary has {mc.vocab_size} ids, the target's {target.vocab_size} "
                         "(a draft must share the target's vocabulary)")
    if mc.max_position_embeddings < max_model_len:
        raise ValueError(f"{key}: the draft serves {mc.max_position_embeddings} positions, fewer than max_model_len "
                         f"{max_model_len}")
    return mc


def load_draft(path: str, target, max_model_len: int, dtype, device, kernels, lm_head_quant: str):
    """(ModelConfig, model) of the draft checkpoint, checked against the target; errors name
    speculative_config.model."""
    from ..models import Qwen3ForCausalLM

    key = "speculative_config.model"
    mc = check_draft(path, target, max_model_len)
    try:
        scheme = parse_quantization_config(mc.quantization_config)
        model = Qwen3ForCausalLM.from_checkpoint(WeightStore(path), mc, scheme, dtype, device, kernels, max_model_len,
                                                 lm_head_quant)
    except Exception as exc:
        raise ValueError(f"{key}: loading {path!r} failed: {exc}") from exc
    return mc, model


class DraftModelMethod:
    """The Proposer (spec/decoder.py) of method draft_model."""

    def __init__(self, k: int, path: str, ctx):
        ecfg = ctx.engine_config
        self.k = k
        self.page_size = ecfg.page_size
        self.device = ctx.device
        self.chunk = ecfg.max_num_batched_tokens
        self.mc, self.model = load_draft(path, ctx.model_config, ctx.max_model_len, ctx.dtype, ctx.device,
                                         ctx.kernels, ecfg.lm_head_quant)
        self.path = os.path.abspath(path)
        pages = ctx.runner.kv_cache.num_pages
        per_token = cache_class("bf16").bytes_per_token(self.mc.num_layers, self.mc.num_kv_heads, self.mc.head_dim,
                                                        ctx.dtype)
        self.kv_cache = allocate_kv_cache("bf16", self.mc, ctx.dtype, ctx.device, ctx.kernels, None, self.page_size,
                                          ctx.max_model_len, ecfg.max_num_seqs,
                                          nbytes=pages * self.page_size * per_token)
        self.block_manager = BlockManager(self.kv_cache.num_pages, self.page_size, ecfg.enable_prefix_caching)
        self.num_faults = 0          # draft forwards that failed (their rows decoded without drafts)
        self.prefix_hits = 0         # tokens whose draft KV came from the draft pool's prefix cache
        log.info("draft model %s: %d layers, hidden %d, %d KV pages", path, self.mc.num_layers, self.mc.hidden_size,
                 self.kv_cache.num_pages)

    # ----- the Proposer interface ------------------------------------------------------------------------
    def new_state(self, seq) -> DraftState:
        st = DraftState()
        if self.block_manager.caching:
            st.root = root_hash(f"draft:{self.kv_cache.content_key}", seq.params.cache_salt)
        return st

    def propose(self, rows) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in rows]
        for r in rows:
            self._sync(r.seq, r.state)
        try:
            with torch.inference_mode():
                self._propose(rows, out)
        except Exception:   # the draft failed: these rows decode plainly this step, no request fails
            self.num_faults += 1
            log.exception("draft model forward failed; %d row(s) decode without drafts this step", len(rows))
            for r in rows:
                r.state.pending = []
            return [[] for _ in rows]
        return out

    def commit(self, seq, state: DraftState, accepted: int) -> None:
        self._sync(seq, state)

    def free(self, seq, state: DraftState) -> None:
        self.block_manager.free(state.table)
        state.computed = state.registered = 0
        state.pending = []

    # ----- internals -------------------------------------------------------------------------------------
    def _sync(self, seq, st: DraftState) -> None:
        """The drafts fed last time that the target emitted stay computed; the pages past them go back; the full
        pages of committed tokens are recorded in the draft prefix cache."""
        if st.pending:
            tokens, base = seq.tokens, st.computed
            m = 0
            while m < len(st.pending) and base + m < len(tokens) and tokens[base + m] == st.pending[m]:
                m += 1
            st.computed = base + m
            st.pending = []
        bm = self.block_manager
        keep = bm.pages_for(st.computed)
        if len(st.table) > keep:
            tail = st.table[keep:]
            del st.table[keep:]
            bm.free(tail)
        if bm.caching:
            full = st.computed // self.page_size
            if full > st.registered:
                extend_hashes(st.hashes, st.root, seq.tokens, self.page_size, full)
                for i in range(st.registered, full):
                    bm.register(st.table[i], st.hashes[i])
                st.registered = full

    def _cached_prefix(self, seq, st: DraftState) -> None:
        """A sequence with no draft KV takes the cached draft pages of its longest run of full pages (leaving
        at least its last token to feed)."""
        bm = self.block_manager
        if not bm.caching or st.table or st.computed:
            return
        full = (seq.num_tokens - 1) // self.page_size
        extend_hashes(st.hashes, st.root, seq.tokens, self.page_size, full)
        pages = bm.match(st.hashes[:full])
        if pages:
            bm.acquire(pages)
            st.table.extend(pages)
            st.registered = len(pages)
            st.computed = len(pages) * self.page_size
            self.prefix_hits += st.computed

    def _propose(self, rows, out: list[list[int]]) -> None:
        bm = self.block_manager
        budget = self.chunk
        feed = []    # (row index, state, tokens, start position)
        for i, r in enumerate(rows):
            seq, st = r.seq, r.state
            self._cached_prefix(seq, st)
            gap = seq.num_tokens - st.computed
            if budget <= 0 or gap <= 0:
                continue
            n = min(gap, budget)
            drafting = n == gap
            need = st.computed + n + (r.room - 1 if drafting else 0)
            if not bm.can_grow(st.table, need):
                continue    # the draft pool is short: no drafts for this row (the target's pool is not touched)
            bm.grow(st.table, need)
            feed.append((i, st, seq.tokens[st.computed:st.computed + n], st.computed, drafting))
            budget -= n
        if not feed:
            return
        nxt = self._forward([(st, toks, start) for _, st, toks, start, _ in feed])
        live = []
        for (i, st, toks, start, drafting), t in zip(feed, nxt):
            st.computed = start + len(toks)
            if drafting:
                out[i].append(t)
                live.append((i, st))
        for j in range(1, max((rows[i].room for i, _ in live), default=0)):
            live = [(i, st) for i, st in live if rows[i].room > j]
            if not live:
                break
            nxt = self._forward([(st, [out[i][-1]], st.computed + len(st.pending)) for i, st in live])
            for (i, st), t in zip(live, nxt):
                st.pending.append(out[i][-1])
                out[i].append(t)

    def _forward(self, batch) -> list[int]:
        """One draft forward over [(state, tokens, first position)]: the greedy next token after each."""
        S = self.page_size
        ids, positions, slots, qsl, lens = [], [], [], [0], []
        for st, toks, start in batch:
            ids.extend(toks)
            positions.extend(range(start, start + len(toks)))
            slots.extend(st.table[p // S] * S + p % S for p in range(start, start + len(toks)))
            qsl.append(qsl[-1] + len(toks))
            lens.append(start + len(toks))
        width = max(len(st.table) for st, _, _ in batch)
        tables = torch.zeros((len(batch), width), dtype=torch.int32)
        for b, (st, _, _) in enumerate(batch):
            tables[b, :len(st.table)] = torch.tensor(st.table, dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
                                 block_tables=tables.to(dev),
                                 query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
                                 seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev))
        hidden = self.model(torch.tensor(ids, dtype=torch.int64, device=dev),
                            torch.tensor(positions, dtype=torch.int64, device=dev), self.kv_cache, meta)
        last = torch.tensor([q - 1 for q in qsl[1:]], dtype=torch.int64, device=dev)
        return self.model.logits(hidden[last]).argmax(dim=-1).tolist()
