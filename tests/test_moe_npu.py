"""The npu set's MoE slot (kernels/npu/moe.py) over emulations of torch_npu's MoE ops written from their documented
semantics (tests/npu_emulation.py): the routing is transformers' router, the A8W8 experts give the reference's
GEMM bits and the output is exactly the documented composition (the set's SwiGLU, finalize_routing's sum of the
k products), within a rounding of the reference; a row alone equals its row in any batch. Not run on an NPU."""
from __future__ import annotations

import pytest
import torch

import npu_emulation
from backend_lib.kernels import REFERENCE
from backend_lib.kernels.npu import kernel_set
from backend_lib.kernels.npu.moe import NpuExperts
from backend_lib.layers.moe import route
from moe_helpers import moe_block

NPU = kernel_set(npu_emulation)
DTYPES = [torch.bfloat16, torch.float16]


def _hidden(t, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, 64, generator=g) * 3).to(dtype)


def _documented(x, ids, weights, ref_pairs):
    """What the ops' documented semantics give: each pair's expert output by the reference's GEMMs with the npu
    set's SwiGLU (npu_swiglu), then per token sum_j w_j * y_j in fp32 over its experts in ascending order,
    rounded once (npu_moe_finalize_routing's formula)."""
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1])
        order = ids[t].argsort()
        for j in order.tolist():
            gate_up, down = ref_pairs[int(ids[t, j])]
            y = down.forward(NPU.silu_mul(gate_up.forward(x[t:t + 1])))[0]
            acc += weights[t, j].to(x.dtype).float() * y.float()
        out[t] = acc.to(x.dtype)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_npu_a8w8_moe_is_the_documented_composition_of_the_reference_gemms(moe_a8w8_ckpt, dtype):
    ref_block, npu_block = moe_block(moe_a8w8_ckpt, REFERENCE, dtype), moe_block(moe_a8w8_ckpt, NPU, dtype)
    assert isinstance(npu_block.moe_weights, NpuExperts) and npu_block.moe_weights.quant
    x = _hidden(13, dtype)
    with torch.inference_mode():
        ids, w = route(ref_block.gate.forward(x), 2, True)
        got = NPU.moe_experts(x, ids, w, npu_block.moe_weights)
        assert got.dtype == dtype and torch.equal(got, _documented(x, ids, w, ref_block.expert_pairs))
        ref = REFERENCE.moe_experts(x, ids, w, ref_block.expert_pairs)
        solo = torch.cat([NPU.moe_experts(x[i:i + 1], ids[i:i + 1], w[i:i + 1], npu_block.moe_weights)
                          for i in range(4)])
        flipped = NPU.moe_experts(x.flip(0), ids.flip(0), w.flip(0), npu_block.moe_weights).flip(0)
    assert torch.equal(solo, got[:4]) and torch.equal(flipped, got)
    # within a rounding of the reference's largest outputs (SwiGLU rounded once, the combine in fp32)
    ulp = ref.float().abs().max() * (2 ** -8 if dtype == torch.bfloat16 else 2 ** -11)
    assert (got.float() - ref.float()).abs().max() <= 2 * ulp and got.abs().sum() > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_npu_float_moe_matches_the_reference_and_is_batch_invariant(moe_bf16_ckpt, dtype):
    ref_block, npu_block = moe_block(moe_bf16_ckpt, REFERENCE, dtype), moe_block(moe_bf16_ckpt, NPU, dtype)
    assert isinstance(npu_block.moe_weights, NpuExperts) and not npu_block.moe_weights.quant
    assert npu_block.moe_weights.w13.shape == (8, 64, 64)            # npu_grouped_matmul's [E, K, N]
    x = _hidden(9, dtype, seed=1)
    with torch.inference_mode():
        ids, w = route(ref_block.gate.forward(x), 2, True)
        got = NPU.moe_experts(x, ids, w, npu_block.moe_weights)
        solo = torch.cat([NPU.moe_experts(x[i:i + 1], ids[i:i + 1], w[i:i + 1], npu_block.moe_weights)
                          for i in range(3)])
        ref = REFERENCE.moe_experts(x, ids, w, ref_block.expert_pairs)
        composed = NPU.moe_experts(x, ids, w, npu_block.expert_pairs)     # the set's linear slots, per expert
    assert torch.equal(solo, got[:3])
    ulp = ref.float().abs().max() * (2 ** -8 if dtype == torch.bfloat16 else 2 ** -11)
    assert (got.float() - ref.float()).abs().max() <= 4 * ulp
    assert (composed.float() - ref.float()).abs().max() <= 4 * ulp


def test_the_npu_router_is_transformers_router_over_the_gating_op():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(17, 8, generator=g).to(torch.bfloat16)
    logits[3] = logits[3, 0]                                           # a row of ties: torch.topk's order
    for norm in (True, False):
        ids, w = NPU.moe_route(logits, 3, norm)
        rids, rw = route(logits, 3, norm)
        assert ids.dtype == torch.int64 and w.dtype == torch.bfloat16
        assert torch.equal(ids, rids) and torch.equal(w, rw)


def test_the_npu_moe_layer_stacks_experts_once_and_its_rows_equal_their_solo_runs(moe_a8w8_ckpt):
    block = moe_block(moe_a8w8_ckpt, NPU, torch.bfloat16)
    packed = block.moe_weights
    assert packed.w13.shape == (8, 64, 64) and packed.w2.shape == (8, 32, 64) and packed.s2.shape == (8, 64)
    for e, (gate_up, down) in enumerate(block.expert_pairs):
        assert gate_up.prepared[0].data_ptr() == packed.w13[e].data_ptr()
        assert down.prepared[0].data_ptr() == packed.w2[e].data_ptr()
    x = _hidden(7, torch.bfloat16, seed=4)
    with torch.inference_mode():                      # the router through npu_moe_gating_top_k_softmax too
        batched = block.forward(x)
        assert torch.equal(torch.cat([block.forward(x[i:i + 1]) for i in range(7)]), batched)


def test_the_emulated_routing_ops_pin_their_documented_index_conventions():
    """init_routing_v2's gather index and counts, finalize_routing's row-ordered (mode 2) and column-ordered
    (mode 0) indices, on a hand-checked case."""
    x = torch.arange(3 * 2, dtype=torch.float32).reshape(3, 2).to(torch.bfloat16)
    ids = torch.tensor([[1, 2], [0, 1], [0, 2]], dtype=torch.int32)
    ex, row_idx, counts, _ = npu_emulation.npu_moe_init_routing_v2(
        x, ids, active_num=6, expert_num=3, expert_tokens_num_type=1, expert_tokens_num_flag=True, quant_mode=-1,
        active_expert_range=[0, 3], row_idx_type=0)
    # sorted pairs (flat t * 2 + j): expert 0: 2, 4; expert 1: 0, 3; expert 2: 1, 5
    assert counts.tolist() == [2, 2, 2] and row_idx.tolist() == [2, 4, 0, 3, 1, 5]
    assert torch.equal(ex, x[torch.tensor([1, 2, 0, 1, 0, 2])])
    rows = torch.arange(6, dtype=torch.bfloat16)[:, None]
    scales = torch.ones(3, 2, dtype=torch.bfloat16)
    out = npu_emulation.npu_moe_finalize_routing(rows, None, None, None, scales, row_idx, ids, drop_pad_mode=2)
    assert out[:, 0].tolist() == [2 + 4, 0 + 3, 1 + 5]      # each token's pairs, wherever they were sorted


# ----- W4A16 experts: npu_grouped_matmul's antiquant form (weight-only int4) ----------------------------------------

W4A16_MOE = {   # name: (format, options) of tiny-moe checkpoints (names shared with the other MoE tests' options)
    "tiny-moe-w4a16-asym": ("w4a16", dict(symmetric=False)),                # compressed-tensors, group 32, zeros
    "tiny-moe-w4a16-g16-asym": ("w4a16", dict(group_size=16, symmetric=False)),
    "tiny-moe-w4a16-channel": ("w4a16", dict(group_size=None)),             # per channel: antiquant_scale [E, N]
    "tiny-moe-gptq-g32": ("gptq", dict(group_size=32)),                     # fp16 scales, zeros 1..16 (v1)
    "tiny-moe-awq-g32": ("awq", dict(group_size=32)),                       # fp16 scales, zeros
}


class _Calls:
    """torch_npu's emulation, recording the names of the ops the set calls."""

    def __init__(self):
        self.names: list[str] = []

    def __getattr__(self, name):
        op = getattr(npu_emulation, name)
        return lambda *a, **kw: self.names.append(name) or op(*a, **kw)


def _int4_expert(e, n, k, group, seed):
    g = torch.Generator().manual_seed(seed + e)
    gs = k // (group or k)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, gs, generator=g) * 0.05 + 1e-3).to(torch.bfloat16).float()     # fit bf16 and fp16
    zeros = torch.randint(0, 17, (n, gs), generator=g).float()                            # GPTQ v1: up to 16
    return codes, scales, zeros


def _documented_int4_weights(experts):
    """npu_grouped_matmul's antiquant arguments written from the docs alone, not by the set: int4 q = code - 8
    packed per expert [K, N] by npu_convert_weight_to_int4pack and stacked [E, K, N / 8]; formula 4's
    (q + offset) * scale with offset = 8 - zero; scales [E, G, N] per group, [E, N] per channel (G = 1)."""
    w = torch.stack([npu_emulation.npu_convert_weight_to_int4pack((c.to(torch.int32) - 8).t().contiguous())
                     for c, _, _ in experts])
    s = torch.stack([sc.t() for _, sc, _ in experts])
    o = torch.stack([(8.0 - z).t() for _, _, z in experts])
    return (w, s[:, 0], o[:, 0]) if s.shape[1] == 1 else (w, s, o)


@pytest.mark.parametrize("group", [16, 32, None])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_emulated_int4_grouped_matmul_is_each_experts_dequantized_weight(group, dtype):
    """The emulation itself against a plain dequantized reference: each segment of rows (group_list's counts,
    an empty expert included) equals the reference W4A16 GEMM of its expert ((code - zero) * scale in fp32, fp32
    matrix-vector) bit for bit, and a float64 x @ W^T within a rounding; the cumsum form (group_list_type 0)
    is the same split; one-hot rows read each expert's dequantized weight back."""
    n, k, counts = 48, 64, [3, 0, 5, 2]
    experts = [_int4_expert(e, n, k, group, seed=7) for e in range(4)]
    w, s, o = _documented_int4_weights(experts)
    assert w.shape == (4, k, n // 8) and s.shape == ((4, k // group, n) if group else (4, n))
    x = (torch.randn(sum(counts), k, generator=torch.Generator().manual_seed(8)) * 2).to(dtype)
    kw = dict(antiquant_scale=[s.to(dtype)], antiquant_offset=[o.to(dtype)], group_type=0, split_item=3)
    got = npu_emulation.npu_grouped_matmul([x], [w], group_list=torch.tensor(counts), group_list_type=1, **kw)[0]
    cum = npu_emulation.npu_grouped_matmul([x], [w], group_list=torch.tensor(counts).cumsum(0), group_list_type=0,
                                           **kw)[0]
    assert got.dtype == dtype and got.shape == (sum(counts), n) and torch.equal(got, cum)
    start = 0
    for (codes, scales, zeros), c in zip(experts, counts):
        rows = x[start:start + c]
        assert torch.equal(got[start:start + c], REFERENCE.w4a16_linear(rows, REFERENCE.w4a16_prepare(codes, scales,
                                                                                                        zeros)))
        gs = k // scales.shape[1]
        wd = (codes.double() - zeros.double().repeat_interleave(gs, 1)) * scales.double().repeat_interleave(gs, 1)
        plain = rows.double() @ wd.t()
        ulp = 2 ** -8 if dtype == torch.bfloat16 else 2 ** -11
        assert ((got[start:start + c].double() - plain).abs() <= plain.abs() * ulp + 1e-6).all()
        start += c
    eye = torch.eye(k, dtype=dtype)
    read = npu_emulation.npu_grouped_matmul([eye.repeat(4, 1)], [w], group_list=torch.full((4,), k), group_list_type=1,
                                            **kw)[0]
    for e, (codes, scales, zeros) in enumerate(experts):
        gs = k // scales.shape[1]
        wd = (codes.float() - zeros.repeat_interleave(gs, 1)) * scales.repeat_interleave(gs, 1)
        assert torch.equal(read[e * k:(e + 1) * k].t(), wd.to(dtype))


def test_the_emulated_int4_grouped_matmul_refuses_what_the_docs_rule_out():
    experts = [_int4_expert(e, 16, 32, 16, seed=1) for e in range(2)]
    w, s, o = _documented_int4_weights(experts)
    x = torch.zeros(3, 32, dtype=torch.bfloat16)
    kw = dict(group_type=0, split_item=3)
    ok = dict(antiquant_scale=[s.bfloat16()], antiquant_offset=[o.bfloat16()], group_list=torch.tensor([1, 2]),
              group_list_type=1)
    npu_emulation.npu_grouped_matmul([x], [w], **ok, **kw)
    for bad, match in ((dict(group_list=torch.tensor([1, 1])), "does not split"),           # off by one
                       (dict(group_list=torch.tensor([2, 2]), group_list_type=0), "does not split"),
                       (dict(antiquant_scale=[s.half()]), "x's dtype"),
                       (dict(antiquant_offset=[o[:, 0].bfloat16()]), "shape and dtype"),       # per channel
                       (dict(antiquant_scale=[torch.zeros(2, 3, 16, dtype=torch.bfloat16)],
                             antiquant_offset=[torch.zeros(2, 3, 16, dtype=torch.bfloat16)]), "divide K")):
        with pytest.raises(AssertionError, match=match):
            npu_emulation.npu_grouped_matmul([x], [w], **{**ok, **bad}, **kw)
    with pytest.raises(AssertionError, match="length cannot be 1"):
        npu_emulation.npu_grouped_matmul([x], [w[:1]], antiquant_scale=[s[:1].bfloat16()],
                                         antiquant_offset=[o[:1].bfloat16()], group_list=torch.tensor([3]),
                                         group_list_type=1, **kw)


def _fits(t: torch.Tensor, dtype) -> bool:
    return torch.equal(t.to(dtype).float(), t.float())


@pytest.mark.parametrize("name", list(W4A16_MOE))
@pytest.mark.parametrize("dtype", DTYPES)
def test_npu_w4a16_moe_runs_the_grouped_antiquant_op_and_is_the_documented_composition(ckpts, name, dtype):
    """W4A16 experts stacked once for npu_grouped_matmul (the per-expert modules view the stacks), run by it
    (no npu_weight_quant_batchmatmul per expert): with scales representable in the model dtype the output is
    the documented composition of the reference's expert GEMMs bit for bit, else within a rounding of it (the
    scales rounded once to the dtype: GPTQ's fp16 scales in a bf16 model); rows alone and reversed equal the
    batch's."""
    ckpt = ckpts.get(name, W4A16_MOE[name][0], "tiny-moe", **W4A16_MOE[name][1])
    calls = _Calls()
    npu = kernel_set(calls)
    ref_block, npu_block = moe_block(ckpt, REFERENCE, dtype), moe_block(ckpt, npu, dtype)
    packed = npu_block.moe_weights
    assert isinstance(packed, NpuExperts) and packed.kind == "w4a16" and not packed.quant
    assert packed.w13.dtype == torch.int32 and packed.w13.shape == (8, 64, 64 // 8) and packed.w2.shape == (8, 32, 8)
    assert packed.s13.shape == packed.o13.shape and packed.s13.shape[-1] == 64 and packed.s2.shape[-1] == 64
    for e, (gate_up, down) in enumerate(npu_block.expert_pairs):      # views of the stacks: held once
        assert [t.data_ptr() for t in gate_up.prepared[:3]] == [packed.w13[e].data_ptr(), packed.s13[e].data_ptr(),
                                                                 packed.o13[e].data_ptr()]
        assert down.prepared[0].data_ptr() == packed.w2[e].data_ptr() and down.prepared[4] is None
    x = _hidden(11, dtype, seed=5)
    with torch.inference_mode():
        ids, w = route(ref_block.gate.forward(x), 2, True)
        calls.names.clear()
        got = npu.moe_experts(x, ids, w, packed)
        assert calls.names == ["npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_swiglu", "npu_grouped_matmul",
                               "npu_moe_finalize_routing"]
        documented = _documented(x, ids, w, ref_block.expert_pairs)
        solo = torch.cat([npu.moe_experts(x[i:i + 1], ids[i:i + 1], w[i:i + 1], packed) for i in range(4)])
        flipped = npu.moe_experts(x.flip(0), ids.flip(0), w.flip(0), packed).flip(0)
    assert got.dtype == dtype and got.abs().sum() > 0
    assert torch.equal(solo, got[:4]) and torch.equal(flipped, got)
    if _fits(packed.s13, dtype) and _fits(packed.s2, dtype):
        assert torch.equal(got, documented)
    else:
        assert W4A16_MOE[name][0] in ("gptq", "awq") and dtype == torch.bfloat16     # fp16 scales, bf16 model
        ulp = documented.float().abs().max() * 2 ** -8
        assert not torch.equal(got, documented) and (got.float() - documented.float()).abs().max() <= 4 * ulp


def test_npu_w4a16_moe_refuses_float32_naming_the_dtype(ckpts):
    block = moe_block(ckpts.get("tiny-moe-w4a16-asym", "w4a16", "tiny-moe", symmetric=False), NPU, torch.float32)
    assert isinstance(block.moe_weights, NpuExperts)
    with pytest.raises(ValueError, match="bfloat16 or float16.*float32"):
        block.forward(_hidden(2, torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_act_order_w4a16_experts_keep_the_composed_path_over_the_dense_op(ckpts, dtype):
    """GPTQ desc_act experts (a perm per expert): npu_grouped_matmul takes no permutation of x, so they stay
    per expert (moe_weights returns the pairs), each through npu_weight_quant_batchmatmul with x gathered by its
    perm: the composed path of the reference GEMMs' bits where the fp16 scales fit (fp16), rows alone the
    batch's; gate and up with their own perms (two modules) too."""
    from backend_lib.kernels.moe import grouped_moe

    ckpt = ckpts.get("tiny-moe-gptq-descact", "gptq", "tiny-moe", group_size=16, desc_act=True)
    calls = _Calls()
    npu = kernel_set(calls)
    block, ref_block = moe_block(ckpt, npu, dtype), moe_block(ckpt, REFERENCE, dtype)
    assert block.moe_weights is block.expert_pairs
    assert all(g.prepared[4] is not None and d.prepared[4] is not None for g, d in block.expert_pairs)
    x = _hidden(6, dtype, seed=6)
    with torch.inference_mode():
        ids, w = route(ref_block.gate.forward(x), 2, True)
        calls.names.clear()
        got = npu.moe_experts(x, ids, w, block.moe_weights)
        assert set(calls.names) == {"npu_weight_quant_batchmatmul", "npu_swiglu"}
        want = grouped_moe(npu, x, ids, w, ref_block.expert_pairs)      # the reference GEMMs, the same combine
        solo = torch.cat([npu.moe_experts(x[i:i + 1], ids[i:i + 1], w[i:i + 1], block.moe_weights) for i in range(6)])
    assert torch.equal(solo, got) and got.abs().sum() > 0
    if dtype == torch.float16:
        assert torch.equal(got, want)
    own = moe_block(ckpts.get("tiny-moe-gptq-descact-own-perms", "gptq", "tiny-moe", group_size=16, desc_act=True,
                              shared_perm=False), NPU, dtype)
    assert own.moe_weights is own.expert_pairs
    with torch.inference_mode():
        assert own.forward(x).abs().sum() > 0
