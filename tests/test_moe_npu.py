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
