"""The one contract every kernel set fills: the `Kernels` dataclass, one slot per operation of the Qwen3 forward.

Shapes (T = tokens in the step, B = sequences in the step, H / KVH = query / KV heads, D = head_dim):
  hidden x            [T, K] in the model dtype
  q / k / v           [T, H, D] / [T, KVH, D] / [T, KVH, D]
  dense KV cache      the set's layout (kv_shapes); by default K [num_pages, KVH, page_size / KW, D, KW]
                      (blocks of KW keys, transposed: kv_cache/layout.py), V [num_pages, KVH, page_size, D]
  TurboQuant cache    K codes [P, KVH, S / KW, D / 2, KW] uint8, V codes [P, KVH, S, D / 2] uint8,
                      scales [P, KVH, S] fp32 (kv_cache/turboquant.py)
  block_tables        [B, max_pages] int32 (page ids of each sequence, padded)
  query_start_loc     [B + 1] int32 (row offsets of each sequence's queries in q)
  seq_lens            [B] int32 (tokens in the cache for the sequence after this step)
  slot_mapping        [T] int64 (page * page_size + offset where each new K/V row goes)

Every set is batch invariant: a row's result depends on that row (and its sequence's context) only, never
on what else shares the step, so chunked prefill, decode and any batch composition give the same bits.
The A8W8 slots are integer math and must match the reference bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..kv_cache.layout import blocked_kv_shapes


@dataclass(frozen=True)
class Kernels:
    name: str
    rms_norm: Callable          # (x, weight, eps) -> normalized x (fp32 math, rounded to x.dtype, times weight)
    add_rms_norm: Callable      # (x, residual, weight, eps) -> (rms_norm(x + residual), x + residual)
    qk_norm_rope: Callable      # (qkv, q_w, k_w, positions, cos_sin, H, KVH, eps) -> (q, k, v)
    silu_mul: Callable          # ([T, 2F] gate | up) -> [T, F] silu(gate) * up
    a8w8_prepare: Callable      # (w_q int8 [N, K], w_scale fp32 [N]) -> the weight in this kernel set's form
    a8w8_linear: Callable       # (x, prepared) -> y in x.dtype (per-token int8 activations, int32 accumulation)
    w4a16_prepare: Callable     # (codes uint8 [N, K] in 0..15, scales fp32 [N, G], zeros fp32 [N, G], perm int64 [K]
                                #  or None) -> the weight in this kernel set's form (int4 weight-only; G groups of
                                #  K / G contiguous columns of the perm-ordered weight, checkpoint/int4.py)
    w4a16_linear: Callable      # (x, prepared) -> y = x[:, perm] ((codes - zeros) * scales)^T in x.dtype, the weight
                                #  dequantized in fp32 exactly as written, fp32 accumulation
    float_prepare: Callable     # w [N, K] -> the weight in this kernel set's form
    float_linear: Callable      # (x, prepared, out_dtype=None) -> y (fp32 accumulation; out_dtype default x.dtype)
    float_rows: Callable        # (prepared, ids) -> rows of w (a tied embedding reads the lm_head's weight)
    write_kv: Callable          # (k, v, k_cache, v_cache, slot_mapping) -> None (scatter the step's K/V rows)
    paged_attention: Callable   # (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale) -> [T, H, D]
    tq_write: Callable          # (k, v, k_codes, k_scales, v_codes, v_scales, slot_mapping, rotation, centroids,
                                #  boundaries) -> None (encode and scatter, see kv_cache/tq_codec.py)
    tq_paged_attention: Callable  # (q, k_codes, k_scales, v_codes, v_scales, block_tables, query_start_loc,
                                  #  seq_lens, rotation, centroids, scale) -> [T, H, D], in the rotated space
    # (num_pages, page_size, KVH, D) -> (K shape, V shape) of a layer's dense cache: the set owns its layout
    # (write_kv and paged_attention read it); the blocked layout above unless a set needs another
    kv_shapes: Callable = blocked_kv_shapes
    # (x [T, K], topk_ids int64 [T, k], topk_weights [T, k] in x.dtype, experts: per expert index its
    #  (gate_up, down) linear modules of this set, or what its moe_weights made of them) -> [T, K] in x.dtype:
    # the routed experts' SwiGLU MLPs, each pair's output times its weight (in x.dtype) added into its token's row in ascending expert index, in
    # x.dtype; None: grouped per expert over this set's own linear slots (kernels/moe.py)
    moe: Callable | None = None
    # (per expert index its (gate_up, down) modules, None where another rank holds it) -> what `moe` takes as
    # `experts` (a set's packed form, made once at load; its modules may be left viewing it); None: the pairs
    moe_weights: Callable | None = None
    # (router logits [T, E] in the model dtype, top_k, norm_topk_prob) -> (ids int64 [T, k], weights [T, k] in
    # the logits' dtype) with transformers' semantics (layers/moe.py's route, the default when None)
    moe_route: Callable | None = None
    # (shape, dtype) -> a zero tensor for a large buffer this set streams every step (the KV pools), on this set's
    #  device; the CPU set's is on transparent huge pages (csrc/memory.cpp); None: torch.zeros on the device
    stream_zeros: Callable | None = None
    # (x [M, K], prepared float weight, ids int64 [C]) -> fp32 [M, C]: float_linear(x, prepared, fp32)[:, ids], the
    # same bits, reading only those rows (a screened greedy head's candidates: layers/greedy_head.py); None: the
    # whole product, indexed
    float_linear_rows: Callable | None = None
    # (A fp32 [B, N], C fp32 [N], D fp32 [N], terms fp32 [B, 3] (s_x, |x|_2, eps, with the margin), coef, limit) ->
    # (ids int64, counts int64 [B]): a screened greedy head's candidates per row, ascending, concatenated; count -1
    # where a row cannot be certified (layers/greedy_head.py has the bound); None: the same formula in torch ops
    greedy_screen: Callable | None = None
    # (x [B, K], the screen's prepared A8W8 weight, C fp32 [N], D fp32 [N], wmax, the float head's prepared weight,
    # coef, margin, limit) -> (picks int64 [B], the candidates' union size): a screened greedy head's whole pick in one
    # call (screen_terms, the int8 product, greedy_screen, float_linear_rows, the first maximum), (all -1, -1) where
    # a row cannot be certified; None: ScreenedHead.greedy_picks composes those steps from the slots above
    greedy_head_picks: Callable | None = None
    # (logits [B, V] fp32 / bf16 on the host) -> (ids, rows): lists of each row's first index of its maximum and of
    # the rows holding a NaN or an infinity, in one read (a step of plain greedy rows); None: sampling/sampler.py's
    # plain_greedy_picks (numpy passes over the fp32 logits)
    argmax_rows: Callable | None = None
    # (codes uint8 [N, K] in 0..15, zero point 8, scales fp32 [N, G]) -> the int4 head in this set's form for
    # w4a8_linear (`lm_head_quant: int4a8`); None: kernels/reference/w4a8.py's (torch ops, any device)
    w4a8_prepare: Callable | None = None
    # (x [M, K], prepared) -> y [M, N] in x.dtype: the int4 head on per-row int8 activations, the arithmetic of
    # kernels/reference/w4a8.py bit for bit; None: that reference
    w4a8_linear: Callable | None = None

    def linear_rows(self, x, prepared, ids):
        """float_linear(x, prepared, fp32)[:, ids] through the set's float_linear_rows where it has one."""
        if self.float_linear_rows is not None:
            return self.float_linear_rows(x, prepared, ids)
        return self.float_linear(x, prepared, torch.float32).index_select(-1, ids)

    def w4a8_prepared(self, codes, scales):
        """The int4 head's weight for w4a8: the set's w4a8_prepare where it has one, else the reference's."""
        if self.w4a8_prepare is not None:
            return self.w4a8_prepare(codes, scales)
        from .reference.w4a8 import w4a8_prepare

        return w4a8_prepare(codes, scales)

    def w4a8(self, x, prepared):
        """The int4 head on int8 activations through the set's w4a8_linear, else the reference (the same bits)."""
        if self.w4a8_linear is not None:
            return self.w4a8_linear(x, prepared)
        from .reference.w4a8 import w4a8_linear

        return w4a8_linear(x, prepared)

    def zeros(self, shape, dtype, device):
        """A zero tensor for a buffer streamed every step (KV pools): the set's stream_zeros, else torch.zeros."""
        if self.stream_zeros is not None and torch.device(device).type == "cpu":
            return self.stream_zeros(list(shape), dtype)
        return torch.zeros(shape, dtype=dtype, device=device)

    def pack_experts(self, pairs):
        return self.moe_weights(pairs) if self.moe_weights is not None else pairs

    def moe_experts(self, x, topk_ids, topk_weights, experts):
        if self.moe is not None:
            return self.moe(x, topk_ids, topk_weights, experts)
        from .moe import grouped_moe

        return grouped_moe(self, x, topk_ids, topk_weights, experts)
