"""Emulations of the torch_npu ops the npu kernel set calls, written from their documented semantics (torch_npu's
API reference and how vllm-ascend calls them): shapes, dtypes, layouts, scale conventions and argument
constraints are checked, the math is done in fp32 / exact integers. A stand-in for `torch_npu` in
kernels.npu.kernel_set(...), so that the day the set meets an NPU only the numerics remain to check."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from backend_lib.kernels import reference as ref


def npu_dynamic_quant(x: torch.Tensor, smooth_scales=None):
    """Per-token symmetric int8: scale = max|x| / 127 per row (fp32, shape x.shape[:-1]); y = round(x / scale).
    (The docs do not say what an all-zero row gives; here scale 1, as the reference.)"""
    assert smooth_scales is None
    assert x.dtype in (torch.float16, torch.bfloat16), f"npu_dynamic_quant: {x.dtype} input"
    xf = x.float()
    amax = xf.abs().amax(-1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    y = torch.clamp(torch.round(xf / scale[..., None]), -128, 127).to(torch.int8)
    return y, scale


def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None):
    """x1 int8 [M, K] @ x2 int8 [K, N] with int32 accumulation; out = acc * scale[N] * pertoken_scale[M, 1] in
    fp32, cast to output_dtype (bf16 / fp16 with a per-token scale)."""
    assert x1.dtype == torch.int8 and x2.dtype == torch.int8 and x1.dim() == 2 and x2.dim() == 2
    assert x1.shape[1] == x2.shape[0], f"npu_quant_matmul: x1 {tuple(x1.shape)} x2 {tuple(x2.shape)}"
    assert scale.shape == (x2.shape[1],) and scale.dtype in (torch.float32, torch.bfloat16)
    assert offset is None and bias is None
    assert pertoken_scale is not None and pertoken_scale.shape == (x1.shape[0],)
    assert pertoken_scale.dtype == torch.float32
    assert output_dtype in (torch.bfloat16, torch.float16), "a per-token scale needs a bf16 / fp16 output"
    acc = ref.int8_matmul(x1, x2.t())
    return (acc.float() * scale.float()[None, :] * pertoken_scale[:, None]).to(output_dtype)


def npu_rms_norm(x, gamma, epsilon=1e-6):
    """(y, rstd): rstd = 1 / sqrt(mean(x^2) + eps) over the last dim (fp32, keepdim); y = x * rstd * gamma."""
    assert gamma.shape == x.shape[-1:]
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    """(y, rstd, x) with x = x1 + x2 (in their dtype) and y = npu_rms_norm(x)."""
    assert x1.shape == x2.shape and x1.dtype == x2.dtype
    x = x1 + x2
    y, rstd = npu_rms_norm(x, gamma, epsilon)
    return y, rstd, x


def npu_swiglu(x, dim=-1):
    """x split in two halves along dim: silu(a) * b (fp32 math)."""
    a, b = x.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(x.dtype)


def _npu_reshape_and_cache(*, key, value, key_cache, value_cache, slot_indices):
    """key / value [T, KVH, D] into the caches [blocks, block_size, KVH, D] at slot = block * block_size + offset."""
    assert slot_indices.dtype == torch.int32 and key.shape[1:] == key_cache.shape[2:]
    assert key_cache.shape == value_cache.shape and key.dtype == key_cache.dtype
    key_cache.view(-1, *key_cache.shape[2:])[slot_indices.long()] = key
    value_cache.view(-1, *value_cache.shape[2:])[slot_indices.long()] = value


def npu_fused_infer_attention_score(query, key, value, *, atten_mask, block_table, input_layout, block_size,
                                    actual_seq_lengths, actual_seq_lengths_kv, num_heads, num_key_value_heads,
                                    scale, sparse_mode):
    """Paged attention, TND queries [T, N, D]; key / value the paged caches as (blocks, block_size, KVH * D);
    actual_seq_lengths: cumulative query ends per sequence, actual_seq_lengths_kv: context lengths (host lists);
    sparse_mode 3 ("rightDownCausal") with the 2048 x 2048 upper-triangular mask: row i of a sequence's n
    queries sees keys <= L - n + i. Returns (attention_out [T, N, D] in the query dtype, softmax_lse)."""
    assert input_layout == "TND" and sparse_mode == 3
    assert isinstance(actual_seq_lengths, list) and isinstance(actual_seq_lengths_kv, list)
    assert atten_mask.shape == (2048, 2048) and atten_mask.dtype == torch.bool
    assert block_size % 16 == 0 and key.shape[1] == block_size and key.shape == value.shape
    t, n, d = query.shape
    assert n == num_heads and key.shape[2] == num_key_value_heads * d and block_table.dtype == torch.int32
    k_rows = key.view(key.shape[0], block_size, num_key_value_heads, d)
    v_rows = value.view_as(k_rows)
    out = torch.empty_like(query)
    lse = torch.empty(t, n, dtype=torch.float32)
    start = 0
    for b, (end, length) in enumerate(zip(actual_seq_lengths, actual_seq_lengths_kv)):
        pages = block_table[b, :-(-length // block_size)].long()
        k = k_rows[pages].reshape(-1, num_key_value_heads, d)[:length].permute(1, 0, 2)    # [KVH, L, D]
        v = v_rows[pages].reshape(-1, num_key_value_heads, d)[:length].permute(1, 0, 2)
        q = query[start:end]
        out[start:end] = ref.attend(q, k, v, length, scale).to(query.dtype)
        start = end
    return out, lse


# ----- the MoE ops (torch_npu's op-plugin docs: npu_moe_gating_top_k_softmax, npu_moe_init_routing_v2,
# npu_grouped_matmul, npu_moe_finalize_routing) ------------------------------------------------------------------

def npu_moe_gating_top_k_softmax(x, finished=None, k=1):
    """softmax over the last dim, then top-k: (y in x's dtype, expert_idx int32, row_idx int32) with
    row_idx = arange(N * k).reshape(k, N).T."""
    assert finished is None and x.dim() == 2 and 0 < k <= min(x.shape[-1], 1024)
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    probs = torch.softmax(x, dim=-1, dtype=torch.float32)
    y, idx = torch.topk(probs, k, dim=-1)
    n = x.shape[0]
    row_idx = torch.arange(n * k, dtype=torch.int32).reshape(k, n).t().contiguous()
    return y.to(x.dtype), idx.to(torch.int32), row_idx


def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                            expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False,
                            quant_mode=0, active_expert_range=(), row_idx_type=0):
    """Dropless routing: sorted_expert, sorted_row = keyValueSort(expert_idx.flatten(), arange(N * K)) (stable
    here; the docs say a key-value sort); expanded_row_idx[sorted_row[i]] = i (row_idx_type 0, a gather index) or
    = sorted_row[i] (1); counts = histogram of the sorted experts over active_expert_range (int64, count mode 1);
    expanded_x[i] = x[sorted_row[i] // K], quantized per row of x when quant_mode is 1 (scale = max|x| / 127,
    round(x / scale)) with expanded_scale[i] that row's scale (fp32)."""
    n, k = expert_idx.shape
    assert x.dim() == 2 and x.shape[0] == n and expert_idx.dtype == torch.int32
    assert scale is None and offset is None and drop_pad_mode == 0
    assert active_num == n * k, "active_num is checked to equal NUM_ROWS * K"
    assert expert_tokens_num_type == 1 and expert_tokens_num_flag, "count mode, counts returned"
    assert quant_mode in (-1, 1) and row_idx_type in (0, 1)
    start, end = active_expert_range
    assert 0 <= start < end <= expert_num and start == 0 and end == expert_num
    flat = expert_idx.reshape(-1).long()
    assert bool(((flat >= 0) & (flat < expert_num)).all())
    sorted_row = torch.argsort(flat, stable=True)
    expanded_row_idx = torch.empty(n * k, dtype=torch.int32)
    if row_idx_type == 0:
        expanded_row_idx[sorted_row] = torch.arange(n * k, dtype=torch.int32)
    else:
        expanded_row_idx[:] = sorted_row.to(torch.int32)
    counts = torch.bincount(flat, minlength=expert_num)[start:end].to(torch.int64)
    src = sorted_row // k
    if quant_mode == 1:
        q, s = npu_dynamic_quant(x)
        return q[src], expanded_row_idx, counts, s[src]
    return x[src], expanded_row_idx, counts, torch.zeros(n * k, dtype=torch.float32)


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                       activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=None,
                       group_list_type=0, act_type=0, output_dtype=None, tuning_config=None):
    """The single-tensor case split along M (group_type 0, split_item 2 / 3: "单单单", x [M, K], weight [E, K, N],
    y [M, N]); rows [c_0 + ... + c_{g-1}, + c_g) of x times weight[g], group_list an int64 tensor of length E
    (<= 1024): the counts c (group_list_type 1: non-negative, length not 1) or their cumsum (0: non-decreasing,
    its last value M). int8 x int8 with output_dtype int32 (no scales): exact int32 accumulation (the int8 GEMM
    of vllm-ascend's decode path); float: fp32 accumulation, the output in x's dtype; weight-only int4
    ("伪量化", formula 4: y_g = x_g @ ((weight_g + antiquant_offset_g) * antiquant_scale_g)): x fp16 / bf16,
    weight int32 [E, K, N / 8] holding int4 (npu_convert_weight_to_int4pack's packing of each [K, N]),
    antiquant_scale / antiquant_offset in x's dtype, [E, N] per channel or [E, G, N] per group of K / G rows of
    K (G dividing K), the output None / x's dtype. The dequantization is done here in fp32 and each row as its
    own fp32 matrix-vector product (the docs give neither the op's internal precision nor its summation order:
    the dense npu_weight_quant_batchmatmul's emulation, expert by expert)."""
    assert len(x) == 1 and len(weight) == 1 and group_type == 0 and split_item in (2, 3) and act_type == 0
    assert all(v is None for v in (bias, offset, activation_input, activation_quant_scale, activation_quant_offset,
                                   tuning_config))
    a, w = x[0], weight[0]
    assert a.dim() == 2 and w.dim() == 3 and a.shape[1] == w.shape[1], f"x {tuple(a.shape)} weight {tuple(w.shape)}"
    assert isinstance(group_list, torch.Tensor) and group_list.dtype == torch.int64 and group_list.dim() == 1
    assert group_list.shape[0] == w.shape[0] and group_list.shape[0] <= 1024
    assert group_list_type in (0, 1)
    if group_list_type == 1:
        assert group_list.shape[0] != 1, "group_list_type 1: the group_list's length cannot be 1"
        counts = group_list
    else:
        counts = torch.diff(group_list, prepend=group_list.new_zeros(1))
    assert bool((counts >= 0).all()) and int(counts.sum()) == a.shape[0], \
        f"group_list {group_list.tolist()} (type {group_list_type}) does not split {a.shape[0]} rows"
    if antiquant_scale is not None:
        return [_antiquant_gmm(a, w, antiquant_scale, antiquant_offset, counts, scale, per_token_scale,
                               output_dtype)]
    assert antiquant_offset is None
    if a.dtype == torch.int8:
        assert w.dtype == torch.int8 and output_dtype == torch.int32 and scale is None and per_token_scale is None
        out = torch.empty(a.shape[0], w.shape[2], dtype=torch.int32)
    else:
        assert w.dtype == a.dtype and scale is None and per_token_scale is None and output_dtype in (None, a.dtype)
        out = torch.empty(a.shape[0], w.shape[2], dtype=a.dtype)
    start = 0
    for g, c in enumerate(counts.tolist()):
        rows = a[start:start + c]
        if a.dtype == torch.int8:
            out[start:start + c] = ref.int8_matmul(rows, w[g].t())
        else:
            out[start:start + c] = (rows.float() @ w[g].float()).to(a.dtype)
        start += c
    return [out]


def _antiquant_gmm(a, w, antiquant_scale, antiquant_offset, counts, scale, per_token_scale, output_dtype):
    """npu_grouped_matmul's weight-only int4 case (see there)."""
    assert scale is None and per_token_scale is None
    assert a.dtype in (torch.float16, torch.bfloat16), f"antiquant: x {a.dtype} (fp16 / bf16)"
    assert output_dtype in (None, a.dtype), f"antiquant: output_dtype {output_dtype} for x {a.dtype}"
    assert w.dtype == torch.int32, "int4 weights are int32 words of 8 (npu_convert_weight_to_int4pack)"
    assert isinstance(antiquant_scale, list) and len(antiquant_scale) == 1
    assert antiquant_offset is None or (isinstance(antiquant_offset, list) and len(antiquant_offset) == 1)
    e, k, n = w.shape[0], w.shape[1], w.shape[2] * 8
    s = antiquant_scale[0]
    assert s.dtype == a.dtype, f"antiquant_scale {s.dtype} must be x's dtype {a.dtype}"
    if s.dim() == 2:
        assert s.shape == (e, n), f"per-channel antiquant_scale {tuple(s.shape)}, want [g, n] = {(e, n)}"
        rows = torch.zeros(k, dtype=torch.long)
    else:
        assert s.dim() == 3 and s.shape[0] == e and s.shape[2] == n, \
            f"per-group antiquant_scale {tuple(s.shape)}, want [g, G, n]"
        assert k % s.shape[1] == 0, f"the groups G = {s.shape[1]} must divide K = {k}"
        rows = torch.arange(k) // (k // s.shape[1])
    o = antiquant_offset[0] if antiquant_offset is not None else None
    if o is not None:
        assert o.shape == s.shape and o.dtype == s.dtype, "antiquant_offset: antiquant_scale's shape and dtype"
    out = torch.empty(a.shape[0], n, dtype=a.dtype)
    start = 0
    for g, c in enumerate(counts.tolist()):
        if c:
            sg = s[g].float().reshape(-1, n)[rows]                                      # [K, N]
            og = o[g].float().reshape(-1, n)[rows] if o is not None else 0.0
            wg = ((_unpack_int4(w[g]).float() + og) * sg).t().contiguous()             # [N, K] fp32
            xf = a[start:start + c].float()
            y = torch.empty(c, n, dtype=torch.float32)
            for i in range(c):
                y[i] = torch.mv(wg, xf[i])
            out[start:start + c] = y.to(a.dtype)
        start += c
    return out


def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                             export_for_source_row, drop_pad_mode=0):
    """out[i] = skip1[i] + skip2[i] + sum_k scales[i, k] * (rows[src_to_dst[idx(i, k)]] + bias[expert[i, k]]),
    idx(i, k) = i + k * NUM_ROWS (drop_pad_mode 0, column-ordered) or i * K + k (2, row-ordered); computed here in
    fp32, the k terms added in order, rounded once to the rows' dtype (the docs give no intermediate rounding)."""
    assert drop_pad_mode in (0, 2) and skip1 is None and skip2 is None and bias is None
    n, k = scales.shape
    rows = expanded_permuted_rows
    assert rows.dim() == 2 and rows.shape[0] == n * k and scales.dtype == rows.dtype
    assert expanded_src_to_dst_row.dtype == torch.int32 and expanded_src_to_dst_row.shape == (n * k,)
    assert export_for_source_row is None or export_for_source_row.shape == (n, k)
    dst = expanded_src_to_dst_row.long()
    out = torch.zeros(n, rows.shape[1], dtype=torch.float32)
    for j in range(k):
        idx = torch.arange(n) * k + j if drop_pad_mode == 2 else torch.arange(n) + j * n
        out += scales[:, j:j + 1].float() * rows[dst[idx]].float()
    return out.to(rows.dtype)


def npu_convert_weight_to_int4pack(weight, inner_k_tiles=0):
    """int32 [d0, d1] holding int4 values in [-8, 7] (d1 % 8 == 0, contiguous) -> int32 [d0, d1 / 8]: element
    2i of a row in the low nibble of byte i, 2i + 1 in its high nibble (aclnnConvertWeightToINT4Pack's
    PackToINT8), the bytes in order, so little-endian word j holds elements 8j .. 8j + 7 at bits 0, 4, .., 28."""
    assert weight.dtype == torch.int32 and weight.dim() == 2 and weight.is_contiguous() and inner_k_tiles == 0
    assert weight.shape[1] % 8 == 0, f"int4pack: last dim {weight.shape[1]} not a multiple of 8"
    assert int(weight.min()) >= -8 and int(weight.max()) <= 7, "int4pack: values outside [-8, 7]"
    nib = (weight & 0xF).to(torch.uint8)
    byte = nib[:, 0::2] | (nib[:, 1::2] << 4)
    return byte.contiguous().view(torch.int32)


def _unpack_int4(packed):
    """npu_convert_weight_to_int4pack's inverse: int32 [d0, d1 / 8] -> int32 [d0, d1], sign-extended nibbles."""
    byte = packed.contiguous().view(torch.uint8).to(torch.int32)
    nib = torch.stack([byte & 0xF, byte >> 4], dim=-1).reshape(packed.shape[0], -1)
    return torch.where(nib >= 8, nib - 16, nib)


def npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None,
                                 quant_offset=None, bias=None, antiquant_group_size=0, inner_precise=0):
    """x fp16 / bf16 [M, K] @ W [K, N], W = (q + antiquant_offset) * antiquant_scale from int4 weight q (int32
    [K, N / 8], npu_convert_weight_to_int4pack's packing); scale / offset in x's dtype, (N,) per channel or
    (ceil(K / group), N) per group of antiquant_group_size rows of K. The dequantization is done here in fp32 and
    each row as its own fp32 matrix-vector product (the docs give neither the op's internal precision nor its
    summation order), the output in x's dtype."""
    assert quant_scale is None and quant_offset is None and bias is None and inner_precise == 0
    assert x.dtype in (torch.float16, torch.bfloat16) and x.dim() == 2
    assert weight.dtype == torch.int32 and weight.dim() == 2 and weight.shape[0] == x.shape[1]
    k, n = weight.shape[0], weight.shape[1] * 8
    assert antiquant_scale.dtype == x.dtype and (antiquant_offset is None or antiquant_offset.dtype == x.dtype)
    if antiquant_group_size == 0:
        assert antiquant_scale.shape == (n,), f"per-channel antiquant_scale {tuple(antiquant_scale.shape)}"
        rows = torch.zeros(k, dtype=torch.long)
    else:
        assert antiquant_scale.shape == (-(-k // antiquant_group_size), n), "per-group antiquant_scale shape"
        rows = torch.arange(k) // antiquant_group_size
    s = antiquant_scale.float().reshape(-1, n)[rows]                          # [K, N]
    o = antiquant_offset.float().reshape(-1, n)[rows] if antiquant_offset is not None else 0.0
    if antiquant_offset is not None:
        assert antiquant_offset.shape == antiquant_scale.shape
    w = ((_unpack_int4(weight).float() + o) * s).t().contiguous()             # [N, K] fp32
    xf = x.float()
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    for i in range(x.shape[0]):
        y[i] = torch.mv(w, xf[i])
    return y.to(x.dtype)
