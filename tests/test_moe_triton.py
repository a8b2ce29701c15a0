"""The Triton set's fused MoE (kernels/triton/moe.py, experts.py), through Triton's interpreter on the CPU: the
pairs sorted by expert and padded to the block, gate/up + SwiGLU and down + router weight as grouped GEMMs, the
combine in each token's ascending expert order. A8W8 equals the reference and the composed path bit for bit,
float and W4A16 experts (act order included) the composed path; a row alone equals its row in any batch; greedy
ids through the engine equal the reference set's."""
from __future__ import annotations

import os
from dataclasses import replace

os.environ["TRITON_INTERPRET"] = "1"      # before the kernels are defined: they run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="the triton package is not installed (pip install -e '.[test]')")

from backend_lib.kernels import REFERENCE, get_kernels  # noqa: E402
from backend_lib.kernels.triton import moe  # noqa: E402
from backend_lib.kernels.triton.experts import PackedExperts  # noqa: E402
from backend_lib.layers.moe import route  # noqa: E402
from helpers import make_engine  # noqa: E402
from moe_helpers import moe_block  # noqa: E402

TRI = get_kernels("cpu", "triton")
# the Triton set without its packed form: each expert keeps the modules the loader made (its own perms, no views of
# the stacks) and runs the composed slot over the set's linear slots (w4a16.py's GEMM per expert and projection)
TRI_COMPOSED = replace(TRI, moe_weights=None)


def _hidden(t, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, 64, generator=g) * 3).to(dtype)


@pytest.mark.parametrize("t,k,e,bm", [(1, 8, 128, 16), (5, 2, 8, 4), (40, 3, 6, 16), (3, 2, 64, 1)])
def test_align_lays_every_pair_once_in_its_experts_padded_run(t, k, e, bm):
    g = torch.Generator().manual_seed(t * k + e)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    sorted_pairs, block_expert, num_padded, perm = moe.align(ids, e, bm)
    p = t * k
    assert torch.equal(ids.gather(1, perm), ids.sort(dim=1).values)
    flat = ids.gather(1, perm).reshape(-1)
    n = int(num_padded)
    assert n % bm == 0 and sorted_pairs.shape[0] >= n and sorted_pairs.shape[0] % bm == 0
    assert sorted_pairs.shape[0] == -(-(p + min(e, p) * (bm - 1)) // bm) * bm     # shapes only: no host read
    assert bool((sorted_pairs[n:] == p).all())
    real = sorted_pairs[:n][sorted_pairs[:n] < p].long()
    assert sorted(real.tolist()) == list(range(p))                             # every pair exactly once
    for b in range(n // bm):                                                   # a block is one expert's
        rows = sorted_pairs[b * bm:(b + 1) * bm].long()
        rows = rows[rows < p]
        assert len(rows) and bool((flat[rows] == int(block_expert[b])).all())
    counts = torch.bincount(flat, minlength=e)
    assert n == int(((counts + bm - 1) // bm * bm).sum())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_a8w8_moe_equals_the_reference_and_the_composed_path_and_is_batch_invariant(moe_a8w8_ckpt, dtype):
    ref_block, tri_block = moe_block(moe_a8w8_ckpt, REFERENCE, dtype), moe_block(moe_a8w8_ckpt, TRI, dtype)
    assert isinstance(tri_block.moe_weights, PackedExperts) and tri_block.moe_weights.quant
    x = _hidden(11, dtype)
    with torch.inference_mode():
        ids, w = route(ref_block.gate.forward(x), 2, True)
        fused = TRI.moe_experts(x, ids, w, tri_block.moe_weights)
        assert torch.equal(fused, REFERENCE.moe_experts(x, ids, w, ref_block.expert_pairs))
        assert torch.equal(fused, TRI.moe_experts(x, ids, w, tri_block.expert_pairs))       # the composed path
        solo = torch.cat([TRI.moe_experts(x[i:i + 1], ids[i:i + 1], w[i:i + 1], tri_block.moe_weights)
                          for i in range(4)])
        flipped = TRI.moe_experts(x.flip(0), ids.flip(0), w.flip(0), tri_block.moe_weights).flip(0)
    assert torch.equal(solo, fused[:4]) and torch.equal(flipped, fused)
    assert fused.dtype == dtype and fused.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_float_moe_equals_the_composed_path_and_is_batch_invariant(moe_bf16_ckpt, dtype):
    block = moe_block(moe_bf16_ckpt, TRI, dtype)
    assert isinstance(block.moe_weights, PackedExperts) and not block.moe_weights.quant
    x = _hidden(10, dtype, seed=1)
    with torch.inference_mode():
        ids, w = route(block.gate.forward(x), 2, True)
        fused = TRI.moe_experts(x, ids, w, block.moe_weights)
        assert torch.equal(fused, TRI.moe_experts(x, ids, w, block.expert_pairs))
        solo = torch.cat([TRI.moe_experts(x[i:i + 1], ids[i:i + 1], w[i:i + 1], block.moe_weights)
                          for i in range(3)])
        ref = REFERENCE.moe_experts(x, ids, w, moe_block(moe_bf16_ckpt, REFERENCE, dtype).expert_pairs)
    assert torch.equal(solo, fused[:3])
    torch.testing.assert_close(fused, ref, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)


def test_the_experts_are_stacked_once(moe_a8w8_ckpt):
    block = moe_block(moe_a8w8_ckpt, TRI, torch.bfloat16)
    packed = block.moe_weights
    assert packed.w13.shape == (8, 64, 64) and packed.w2.shape == (8, 64, 32) and packed.s13.shape == (8, 64)
    for e, (gate_up, down) in enumerate(block.expert_pairs):      # views of the stacks: held once
        assert gate_up.prepared[0].data_ptr() == packed.w13[e].data_ptr()
        assert down.prepared[0].data_ptr() == packed.w2[e].data_ptr()


def _descact_ckpt(ckpts, own: bool, **kw):
    """A tiny GPTQ desc_act MoE: a random act order per expert and projection (gate and up sharing theirs, as GPTQ
    writes them, or each its own: the loader's ConcatLinear of the two)."""
    name = "tiny-moe-gptq-descact" + ("-own-perms" if own else "") + "".join(f"-{k}{v}" for k, v in kw.items())
    return ckpts.get(name, "gptq", "tiny-moe", group_size=16, desc_act=True, **({"shared_perm": False} if own else {}),
                     **kw)


@pytest.mark.parametrize("own", [False, True], ids=["shared-gate-up-perm", "own-perms"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_act_order_w4a16_moe_equals_the_composed_path_and_is_batch_invariant(ckpts, own, dtype):
    """GPTQ act-order experts stacked once with their perms and gathered in the grouped GEMMs: the bits of the
    composed slot over the loader's own modules (each expert's projections through w4a16.py's GEMM with their own
    perms, nothing viewing the stacks), rows alone and reversed the batch's, the reference within fp32 tolerance."""
    ckpt = _descact_ckpt(ckpts, own)
    block = moe_block(ckpt, TRI, dtype)
    packed = block.moe_weights
    assert isinstance(packed, PackedExperts) and packed.w13.shape == (8, 64, 32) and packed.p2.shape == (8, 32)
    assert packed.p13.shape == ((8, 2, 64) if own else (8, 64)) and packed.p13.dtype == torch.int32
    gate_perms = packed.p13[:, 0] if own else packed.p13
    assert not torch.equal(gate_perms[0], gate_perms[1]) and not torch.equal(packed.p2[0], packed.p2[1])
    assert not own or not torch.equal(packed.p13[0, 0], packed.p13[0, 1])           # gate's and up's own
    for e, (gate_up, down) in enumerate(block.expert_pairs):      # views of the stacks: held once
        gu = list(gate_up.parts) if own else [gate_up]
        assert [m.prepared[3].data_ptr() for m in gu] == \
            [(packed.p13[e, j] if own else packed.p13[e]).data_ptr() for j in range(len(gu))]
        assert gu[-1].prepared[0].data_ptr() == packed.w13[e, 32 if own else 0].data_ptr()
        assert down.prepared[3].data_ptr() == packed.p2[e].data_ptr()
    composed = moe_block(ckpt, TRI_COMPOSED, dtype)
    assert composed.moe_weights is composed.expert_pairs
    x = _hidden(9, dtype, seed=4)
    with torch.inference_mode():
        ids, w = route(block.gate.forward(x), 2, True)
        fused = TRI.moe_experts(x, ids, w, packed)
        assert torch.equal(fused, TRI_COMPOSED.moe_experts(x, ids, w, composed.expert_pairs))
        assert torch.equal(fused, TRI.moe_experts(x, ids, w, block.expert_pairs))   # the views, composed
        solo = torch.cat([TRI.moe_experts(x[i:i + 1], ids[i:i + 1], w[i:i + 1], packed) for i in range(3)])
        flipped = TRI.moe_experts(x.flip(0), ids.flip(0), w.flip(0), packed).flip(0)
        ref = REFERENCE.moe_experts(x, ids, w, moe_block(ckpt, REFERENCE, dtype).expert_pairs)
    assert torch.equal(solo, fused[:3]) and torch.equal(flipped, fused) and fused.abs().sum() > 0
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(fused, ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("fmt,opts", [("w4a16", dict(group_size=32)), ("w4a16", dict(group_size=16, symmetric=False)),
                                      ("awq", dict(group_size=32))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_w4a16_moe_equals_the_composed_path_and_is_batch_invariant(ckpts, fmt, opts, dtype):
    """Packed int4 experts stacked once and dequantized in the grouped GEMMs (a group per K tile, group 32, and
    several per tile, group 16): the composed path's bits (each expert through w4a16.py's GEMM), rows alone
    and reversed the batch's, the reference within fp32 summation-order tolerance."""
    ckpt = ckpts.get(f"tiny-moe-{fmt}-g{opts['group_size']}{'-asym' if 'symmetric' in opts else ''}", fmt,
                     "tiny-moe", **opts)
    block = moe_block(ckpt, TRI, dtype)
    packed = block.moe_weights
    assert isinstance(packed, PackedExperts) and packed.w13.dtype == torch.uint8
    assert packed.w13.shape == (8, 64, 32) and packed.z13.shape == (8, 64, 64 // opts["group_size"])
    for e, (gate_up, down) in enumerate(block.expert_pairs):      # views of the stacks: held once
        assert gate_up.prepared[0].data_ptr() == packed.w13[e].data_ptr()
        assert down.prepared[2].data_ptr() == packed.z2[e].data_ptr()
    x = _hidden(9, dtype, seed=3)
    with torch.inference_mode():
        ids, w = route(block.gate.forward(x), 2, True)
        fused = TRI.moe_experts(x, ids, w, packed)
        assert torch.equal(fused, TRI.moe_experts(x, ids, w, block.expert_pairs))       # the composed path
        solo = torch.cat([TRI.moe_experts(x[i:i + 1], ids[i:i + 1], w[i:i + 1], packed) for i in range(3)])
        flipped = TRI.moe_experts(x.flip(0), ids.flip(0), w.flip(0), packed).flip(0)
        ref = REFERENCE.moe_experts(x, ids, w, moe_block(ckpt, REFERENCE, dtype).expert_pairs)
    assert torch.equal(solo, fused[:3]) and torch.equal(flipped, fused) and fused.abs().sum() > 0
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(fused, ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_engine_greedy_with_the_fused_moe_equals_the_reference_set(moe_a8w8_ckpt):
    """The whole model, A8W8 experts through the fused kernels, two prompts in one batch: the reference set's
    greedy ids (the attention is the Triton set's own, exact to the reference's ids as the dense model's is;
    rows alone vs batched are the layer tests above and tests/test_cuda_graphs.py's padded decode)."""
    ids_of = {}
    for kernels in ("triton", "reference"):
        eng = make_engine(moe_a8w8_ckpt, dtype="bfloat16", kernels=kernels)
        prompts = [eng.tokenizer.encode(p) for p in ("Hello, world!", "介绍一下北京")]
        params = eng.make_params({"temperature": 0, "max_tokens": 3, "ignore_eos": True})
        ids_of[kernels] = [r["output_ids"] for r in eng.generate(prompts, params)]
    assert ids_of["triton"] == ids_of["reference"] and len(ids_of["triton"][0]) == 3


def test_engine_greedy_with_fused_w4a16_experts_batched_equals_solo(ckpts):
    """The whole W4A16 MoE model through the Triton set (the int4 GEMM for attention, the fused int4 experts):
    each prompt's greedy ids alone equal its ids in one batch. A 3,000-token vocabulary (prompts of ids below it):
    the interpreted head over Qwen3's 151,936 rows is not what this test is about and was most of its time."""
    eng = make_engine(ckpts.get("tiny-moe-w4a16-v3000", "w4a16", "tiny-moe", vocab_size=3000), dtype="bfloat16",
                      kernels="triton")
    assert isinstance(eng.runner.model.layers[0].mlp.moe_weights, PackedExperts)
    prompts = [[9, 2047, 13, 1879], [2999, 100, 1500, 7, 42]]
    params = eng.make_params({"temperature": 0, "max_tokens": 3, "ignore_eos": True})
    solo = [eng.generate([p], params)[0]["output_ids"] for p in prompts]
    assert all(len(s) == 3 for s in solo) and [r["output_ids"] for r in eng.generate(prompts, params)] == solo


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_a8w8_moe_at_ragged_widths_equals_the_reference(dtype):
    """Hidden and expert widths that are no multiple of the tiles (the K masks, the clamped columns): E = 5
    experts, k = 3, hidden 40, width 24; some experts get no pair."""
    from backend_lib.kernels.triton.experts import moe_weights
    from backend_lib.layers.linear import A8W8Linear

    g = torch.Generator().manual_seed(7)
    e_n, hid, inter, k = 5, 40, 24, 3
    weights = [(torch.randint(-128, 128, (2 * inter, hid), generator=g, dtype=torch.int8),
                torch.rand(2 * inter, generator=g) * 0.02,
                torch.randint(-128, 128, (hid, inter), generator=g, dtype=torch.int8),
                torch.rand(hid, generator=g) * 0.02) for _ in range(e_n)]
    ref = [(A8W8Linear(a, b, REFERENCE), A8W8Linear(c, d, REFERENCE)) for a, b, c, d in weights]
    packed = moe_weights([(A8W8Linear(a, b, TRI), A8W8Linear(c, d, TRI)) for a, b, c, d in weights])
    assert isinstance(packed, PackedExperts)
    x = (torch.randn(6, hid, generator=g) * 2).to(dtype)
    ids = torch.stack([torch.randperm(e_n - 1, generator=g)[:k] for _ in range(6)])     # expert 4 unused
    w = torch.softmax(torch.randn(6, k, generator=g), -1).to(dtype)
    with torch.inference_mode():
        got = TRI.moe_experts(x, ids, w, packed)
        assert torch.equal(got, REFERENCE.moe_experts(x, ids, w, ref))
        assert torch.equal(TRI.moe_experts(x[2:3], ids[2:3], w[2:3], packed), got[2:3])


def test_engine_greedy_with_fused_act_order_experts_equals_the_reference_set(ckpts):
    """The whole GPTQ desc_act MoE model (gate and up with their own perms) through the Triton set (w4a16.py's
    gathered GEMM for attention, the fused act-order experts): the reference set's greedy ids, two prompts in one
    batch, and each prompt's ids alone its ids batched. A 3,000-token vocabulary, as the W4A16 engine test."""
    ckpt = _descact_ckpt(ckpts, True, vocab_size=3000)
    prompts = [[9, 2047, 13, 1879], [2999, 100, 1500, 7, 42]]
    ids_of = {}
    for kernels in ("triton", "reference"):
        eng = make_engine(ckpt, dtype="bfloat16", kernels=kernels)
        params = eng.make_params({"temperature": 0, "max_tokens": 3, "ignore_eos": True})
        ids_of[kernels] = [r["output_ids"] for r in eng.generate(prompts, params)]
        if kernels == "triton":
            packed = eng.runner.model.layers[0].mlp.moe_weights
            assert isinstance(packed, PackedExperts) and packed.p13 is not None and packed.p2 is not None
            assert [eng.generate([p], params)[0]["output_ids"] for p in prompts] == ids_of["triton"]
    assert ids_of["triton"] == ids_of["reference"] and len(ids_of["triton"][0]) == 3


@pytest.mark.parametrize("hid,inter,group", [(41, 25, None), (48, 24, 8)])
def test_fused_w4a16_moe_at_ragged_widths_equals_the_composed_path(hid, inter, group):
    """Odd widths (the last byte's unused nibble, the K masks, the clamped columns), channel-wise, and groups
    of 8 (several per K tile): E = 5 experts, k = 3, some experts get no pair."""
    from backend_lib.checkpoint.int4 import Int4Weight
    from backend_lib.kernels.triton.experts import moe_weights
    from backend_lib.layers.linear import W4A16Linear

    g = torch.Generator().manual_seed(11)
    e_n, k = 5, 3

    def weight(n, kk):
        groups = kk // (group or kk)
        return Int4Weight(torch.randint(0, 16, (n, kk), generator=g, dtype=torch.uint8),
                          torch.rand(n, groups, generator=g) * 0.05 + 1e-3,
                          torch.randint(0, 17, (n, groups), generator=g).float(), group or kk, None)

    ws = [(weight(2 * inter, hid), weight(hid, inter)) for _ in range(e_n)]
    pairs = [(W4A16Linear(a, TRI), W4A16Linear(b, TRI)) for a, b in ws]
    ref = [(W4A16Linear(a, REFERENCE), W4A16Linear(b, REFERENCE)) for a, b in ws]
    packed = moe_weights(pairs)
    assert isinstance(packed, PackedExperts) and packed.w13.shape == (e_n, 2 * inter, (hid + 1) // 2)
    x = (torch.randn(6, hid, generator=g) * 2).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e_n - 1, generator=g)[:k] for _ in range(6)])     # expert 4 unused
    w = torch.softmax(torch.randn(6, k, generator=g), -1).to(torch.bfloat16)
    with torch.inference_mode():
        got = TRI.moe_experts(x, ids, w, packed)
        assert torch.equal(got, TRI.moe_experts(x, ids, w, pairs))
        assert torch.equal(TRI.moe_experts(x[2:3], ids[2:3], w[2:3], packed), got[2:3])
        expected = REFERENCE.moe_experts(x, ids, w, ref)
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


@pytest.mark.parametrize("split", [False, True], ids=["gate-up-fused", "gate-up-apart"])
@pytest.mark.parametrize("hid,inter,group", [(32, 32, 16), (41, 25, None), (48, 24, 8)])
def test_fused_act_order_w4a16_moe_at_random_perms_equals_the_composed_path(hid, inter, group, split):
    """Random act orders, different per expert and per projection (gate_up, or gate and up apart as the loader's
    ConcatLinear, and down), one expert without any (the identity in the stack), over odd widths, channel-wise
    and groups smaller than a K tile; hidden == width too (so down reading gate_up's perms would be well formed):
    the composed slot over unstacked copies of the same modules bit for bit, a row alone its row batched."""
    from backend_lib.checkpoint.int4 import Int4Weight
    from backend_lib.kernels.triton.experts import moe_weights
    from backend_lib.layers.linear import ConcatLinear, W4A16Linear

    g = torch.Generator().manual_seed(13 + hid)
    e_n, k = 6, 3

    def weight(n, kk, perm=True):
        groups = kk // (group or kk)
        return Int4Weight(torch.randint(0, 16, (n, kk), generator=g, dtype=torch.uint8),
                          torch.rand(n, groups, generator=g) * 0.05 + 1e-3,
                          torch.randint(0, 17, (n, groups), generator=g).float(), group or kk,
                          torch.randperm(kk, generator=g) if perm else None)

    def gate_up(ws, kernels):
        if not split:
            return W4A16Linear(ws[0], kernels)
        return ConcatLinear([W4A16Linear(w, kernels) for w in ws])

    ws = [([weight(2 * inter, hid, e != 2)] if not split else [weight(inter, hid, e != 2), weight(inter, hid)],
           weight(hid, inter, e != 2)) for e in range(e_n)]                     # expert 2: no perm
    pairs = [(gate_up(a, TRI), W4A16Linear(b, TRI)) for a, b in ws]
    apart = [(gate_up(a, TRI), W4A16Linear(b, TRI)) for a, b in ws]             # unstacked: their own tensors
    ref = [(gate_up(a, REFERENCE), W4A16Linear(b, REFERENCE)) for a, b in ws]
    packed = moe_weights(pairs)
    assert isinstance(packed, PackedExperts) and packed.p13.shape == ((e_n, 2, hid) if split else (e_n, hid))
    assert torch.equal(packed.p2[2], torch.arange(inter, dtype=torch.int32)) and pairs[2][1].prepared[3] is None
    x = (torch.randn(7, hid, generator=g) * 2).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e_n - 1, generator=g)[:k] for _ in range(7)])     # expert 5 unused
    ids[0] = torch.tensor([2, 0, 4])
    w = torch.softmax(torch.randn(7, k, generator=g), -1).to(torch.bfloat16)
    with torch.inference_mode():
        got = TRI.moe_experts(x, ids, w, packed)
        assert torch.equal(got, TRI.moe_experts(x, ids, w, apart))
        assert torch.equal(TRI.moe_experts(x[2:3], ids[2:3], w[2:3], packed), got[2:3])
        expected = REFERENCE.moe_experts(x, ids, w, ref)
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
