"""The npu set's W4A16 slots (npu_convert_weight_to_int4pack + npu_weight_quant_batchmatmul) against the reference,
through the emulations written from the ops' documented semantics (tests/npu_emulation.py). Not run on an NPU.

Bits are compared: with scales representable in the model dtype (the op takes antiquant_scale in x's dtype) and
integer zero points, the documented dequantization (q + (8 - zero)) * scale is the reference's (code - zero) *
scale, and the emulation sums each row as the reference does (fp32 matrix-vector). A W4A16 MoE's experts run
npu_grouped_matmul's antiquant form (kernels/npu/moe.py; tests/test_moe_npu.py pins its bits): here the whole
engine on it."""
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


def _weight(n, k, group, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    groups = k // (group or k)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, groups, generator=g) * 0.05 + 1e-3).to(dtype).float()
    zeros = torch.randint(0, 16, (n, groups), generator=g).float()
    return codes, scales, zeros


@pytest.mark.parametrize("group", [32, 64, None])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("permuted", [False, True])
def test_w4a16_linear_is_the_reference_bits_and_batch_invariant(group, dtype, permuted):
    n, k = 72, 128
    codes, scales, zeros = _weight(n, k, group, dtype)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(1)) if permuted else None
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    prepared = NPU.w4a16_prepare(codes, scales, zeros, perm)
    assert prepared[0].dtype == torch.int32 and prepared[0].shape == (k, n // 8)     # int4pack of [K, N]
    got = NPU.w4a16_linear(x, prepared)
    ref = REFERENCE.w4a16_linear(x, REFERENCE.w4a16_prepare(codes, scales, zeros, perm))
    assert got.dtype == dtype and got.shape == (11, n) and torch.equal(got, ref)
    for lo, hi in ((0, 1), (4, 5), (3, 9), (10, 11)):
        assert torch.equal(NPU.w4a16_linear(x[lo:hi], prepared), got[lo:hi])
    assert torch.equal(NPU.w4a16_linear(x.reshape(1, 11, k), prepared)[0], got)


def test_w4a16_one_hot_rows_read_back_the_dequantized_weight():
    """x = e_j gives column j of W: (code - zero) * scale for every output, the zero's sign included."""
    codes, scales, zeros = _weight(16, 64, 32, torch.bfloat16, seed=3)
    eye = torch.eye(64, dtype=torch.bfloat16)
    w = NPU.w4a16_linear(eye, NPU.w4a16_prepare(codes, scales, zeros))
    expected = (codes.float() - zeros.repeat_interleave(32, 1)) * scales.repeat_interleave(32, 1)
    assert torch.equal(w.t(), expected.to(torch.bfloat16))


def test_the_emulated_int4pack_pins_its_documented_nibble_order():
    """aclnnConvertWeightToINT4Pack: element 2i in the low nibble of byte i, 2i + 1 in the high one."""
    w = torch.tensor([[1, 2, 3, 4, 5, 6, -8, -1]], dtype=torch.int32)
    packed = npu_emulation.npu_convert_weight_to_int4pack(w)
    assert packed.shape == (1, 1) and packed.view(torch.uint8).tolist() == [[0x21, 0x43, 0x65, 0xF8]]


def test_w4a16_refuses_what_int4pack_cannot_hold():
    codes, scales, zeros = _weight(12, 64, 32, torch.bfloat16)
    with pytest.raises(ValueError, match="N % 8"):
        NPU.w4a16_prepare(codes, scales, zeros)
    codes, scales, zeros = _weight(16, 64, 32, torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        NPU.w4a16_linear(torch.zeros(1, 64), NPU.w4a16_prepare(codes, scales, zeros))


@pytest.fixture(scope="module")
def moe_w4a16_ckpt(ckpts):
    # the name other modules build with these options (a name is built once per session, with its first options)
    return ckpts.get("tiny-moe-w4a16-asym", "w4a16", "tiny-moe", symmetric=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_npu_w4a16_moe_equals_the_reference_moe(moe_w4a16_ckpt, dtype):
    ref_block, npu_block = moe_block(moe_w4a16_ckpt, REFERENCE, dtype), moe_block(moe_w4a16_ckpt, NPU, dtype)
    prep = npu_block.expert_pairs[0][0].prepared
    assert len(prep) == 5 and prep[0].dtype == torch.int32                # the npu set's int4pack form
    assert isinstance(npu_block.moe_weights, NpuExperts) and npu_block.moe_weights.kind == "w4a16"
    x = (torch.randn(9, 64, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    with torch.inference_mode():
        ids, w = route(ref_block.gate.forward(x), 2, True)
        got = NPU.moe_experts(x, ids, w, npu_block.moe_weights)
        ref = REFERENCE.moe_experts(x, ids, w, ref_block.expert_pairs)
        solo = torch.cat([NPU.moe_experts(x[i:i + 1], ids[i:i + 1], w[i:i + 1], npu_block.moe_weights)
                          for i in range(3)])
    assert torch.equal(solo, got[:3]) and got.abs().sum() > 0
    # the experts' GEMMs are the reference's bits (npu_grouped_matmul's antiquant form); SwiGLU is npu_swiglu
    # (one rounding, the reference rounds silu) and finalize_routing sums in fp32 (tests/test_moe_npu.py: bits)
    ulp = ref.float().abs().max() * (2 ** -8 if dtype == torch.bfloat16 else 2 ** -11)
    assert (got.float() - ref.float()).abs().max() <= 4 * ulp


def test_engine_greedy_with_kernels_npu_gives_the_reference_ids_on_a_w4a16_moe(moe_w4a16_ckpt, monkeypatch):
    """The whole model on the npu set (its attention, norms, router, W4A16 linears and experts, emulated) against
    the reference set: the same greedy ids, alone and batched."""
    import backend_lib.kernels.npu as npu
    from helpers import make_engine

    loaded = []
    monkeypatch.setattr(npu, "load", lambda device: loaded.append(device) or NPU)   # the emulation for torch_npu
    eng = make_engine(moe_w4a16_ckpt, kernels="npu", dtype="bfloat16")
    ref = make_engine(moe_w4a16_ckpt, kernels="reference", dtype="bfloat16")
    assert loaded
    sparse = [layer.mlp for layer in eng.runner.model.layers if hasattr(layer.mlp, "moe_weights")]
    assert sparse and all(isinstance(m.moe_weights, NpuExperts) and m.moe_weights.kind == "w4a16" for m in sparse)
    prompts = [eng.tokenizer.encode(p) for p in ("Hello!", "1, 2, 3, 4,")]
    params = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
    want = [r["output_ids"] for r in ref.generate(prompts, ref.make_params(params))]
    assert [r["output_ids"] for r in eng.generate(prompts, eng.make_params(params))] == want
    assert [eng.generate([p], eng.make_params(params))[0]["output_ids"] for p in prompts] == want
