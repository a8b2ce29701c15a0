"""TurboQuant 4-bit KV cache: codebook, distortion, storage, rotated-space attention, engine."""
from __future__ import annotations

import pytest
import torch

from backend_lib.checkpoint import ModelConfig
from backend_lib.kernels import REFERENCE, get_kernels
from backend_lib.kernels import reference as ref
from backend_lib.kv_cache import tq_codec as codec
from backend_lib.kv_cache.layout import key_block_width
from backend_lib.kv_cache.dense import DenseKVCache
from backend_lib.kv_cache.pool import allocate_kv_cache
from backend_lib.kv_cache.turboquant import TurboQuantKVCache
from helpers import make_engine
from kernel_helpers import tq_setup

CPU = get_kernels("cpu")


def test_codebook_is_lloyd_max_for_n_0_1_over_d():
    cents, bounds = codec.tq_codebook(128)
    expected = torch.tensor([0.1283950, 0.3880483, 0.6567591, 0.9423405, 1.2562312, 1.6180464, 2.0690172,
                             2.7325896]) / 128 ** 0.5
    assert torch.allclose(cents[8:], expected) and torch.allclose(cents[:8], -expected.flip(0))
    assert torch.allclose(bounds, (cents[1:] + cents[:-1]) / 2)


def test_rotations_are_orthogonal_seeded_and_per_layer():
    r0 = codec.tq_rotation(128, codec.tq_layer_seed(0, 0))
    assert torch.allclose(r0 @ r0.t(), torch.eye(128), atol=1e-5)
    assert torch.equal(r0, codec.tq_rotation(128, codec.tq_layer_seed(0, 0)))
    assert not torch.equal(r0, codec.tq_rotation(128, codec.tq_layer_seed(0, 1)))
    assert not torch.equal(r0, codec.tq_rotation(128, codec.tq_layer_seed(1, 0)))


def _encode_with(kernels, x, rot, cents, bounds):
    """Encodes rows [N, d] through a kernel set's paged write; returns codes, scales."""
    n, d = x.shape
    pages = -(-n // 16)
    k_codes = torch.zeros(pages, 1, 1, d // 2, 16, dtype=torch.uint8)   # [P, KVH, S/KW, D/2, KW], S = 16
    v_codes = torch.zeros(pages, 1, 16, d // 2, dtype=torch.uint8)      # [P, KVH, S, D/2]
    k_scales, v_scales = torch.zeros(pages, 1, 16), torch.zeros(pages, 1, 16)
    kernels.tq_write(x[:, None], x[:, None], k_codes, k_scales, v_codes, v_scales, torch.arange(n), rot, cents,
                     bounds)
    k_rows = ref.key_blocks_to_rows(k_codes).reshape(-1, d // 2)[:n]
    v_rows = v_codes.reshape(-1, d // 2)[:n]
    assert torch.equal(k_rows, v_rows) and torch.equal(k_scales, v_scales)
    return v_rows, v_scales.reshape(-1)[:n]


@pytest.mark.parametrize("d", [128, 64])
def test_mse_on_random_unit_vectors_is_near_the_paper(d):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10_000, d, generator=g)
    x = x / x.norm(dim=1, keepdim=True)
    cents, bounds = codec.tq_codebook(d)
    rot = codec.tq_rotation(d, 123)
    for kernels in (REFERENCE, CPU):
        codes, scales = _encode_with(kernels, x, rot, cents, bounds)
        recon = codec.tq_decode(codes, scales, rot, cents)
        mse = (recon - x).pow(2).sum(1).mean().item()
        print(f"\nd={d} {kernels.name}: D_mse = {mse:.5f}")
        assert 0.0039 < mse <= 0.0100
        torch.testing.assert_close(recon.norm(dim=1), torch.ones(10_000), atol=1e-3, rtol=0)


def test_cpu_encode_matches_reference():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2000, 128, generator=g) * 3
    cents, bounds = codec.tq_codebook(128)
    rot = codec.tq_rotation(128, 5)
    c_ref, s_ref = codec.tq_encode(x, rot, cents, bounds)
    c_cpu, s_cpu = _encode_with(CPU, x, rot, cents, bounds)
    idx_ref, idx_cpu = ref.tq_unpack(c_ref), ref.tq_unpack(c_cpu)
    differ = (idx_ref != idx_cpu)
    assert differ.float().mean() < 1e-3            # only coordinates sitting on a decision boundary
    assert (idx_ref - idx_cpu)[differ].abs().max() <= 1 if differ.any() else True
    torch.testing.assert_close(s_cpu[~differ.any(1)], s_ref[~differ.any(1)], rtol=1e-5, atol=0)


def test_storage_is_68_bytes_per_token_per_kv_head_and_holds_3_7x_the_tokens():
    assert TurboQuantKVCache.bytes_per_token(1, 1, 128, torch.bfloat16) == 2 * 68
    assert DenseKVCache.bytes_per_token(1, 1, 128, torch.bfloat16) == 2 * 256
    cfg = ModelConfig.from_dicts({"model_type": "qwen3", "vocab_size": 100, "hidden_size": 1024,
                                  "intermediate_size": 3072, "num_hidden_layers": 2, "num_attention_heads": 16,
                                  "num_key_value_heads": 8, "head_dim": 128})
    budget = 64 * 2**20
    kw = dict(budget=budget, page_size=16, max_model_len=256, max_num_seqs=10_000)
    dense = allocate_kv_cache("bf16", cfg, torch.bfloat16, torch.device("cpu"), REFERENCE, **kw)
    tq = allocate_kv_cache("tq", cfg, torch.bfloat16, torch.device("cpu"), REFERENCE, **kw)
    ratio = tq.num_pages / dense.num_pages
    print(f"\nsame 64 MiB budget: bf16 {dense.num_pages * 16} tokens, tq {tq.num_pages * 16} tokens ({ratio:.2f}x)")
    assert ratio >= 3.7
    used = sum(t.numel() * t.element_size() for t in tq.k_codes + tq.v_codes + tq.k_scales + tq.v_scales)
    assert used <= budget


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("kernels", [REFERENCE, CPU], ids=lambda k: k.name)
def test_rotated_space_attention_equals_dequantize_then_attend(kernels, page_size):
    # decode at 50 (several pages), a prefill chunk of 20 over 13 cached tokens, whole prompts of 40 and 90;
    # GQA 4:1
    cache, q, bt, qsl, lens = tq_setup([50, 33, 40, 90], [1, 20, 40, 90], page_size=page_size)
    rot, cents = cache.rotations[0], cache.centroids
    got = kernels.tq_paged_attention(q, cache.k_codes[0], cache.k_scales[0], cache.v_codes[0], cache.v_scales[0], bt,
                                     qsl, lens, rot, cents, 0.125)
    k_rows = ref.key_blocks_to_rows(cache.k_codes[0])                           # [P, KVH, S, D/2]
    k_dense = codec.tq_decode(k_rows, cache.k_scales[0], rot, cents)             # back to the original space
    v_dense = codec.tq_decode(cache.v_codes[0], cache.v_scales[0], rot, cents)
    p, h, s, d = k_dense.shape
    kw = key_block_width(s)
    k_dense = k_dense.reshape(p, h, s // kw, kw, d).transpose(3, 4).contiguous()   # the dense blocked K layout
    expected = ref.paged_attention(q, k_dense, v_dense, bt, qsl, lens, 0.125)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("page_size,d,h", [(16, 64, 8), (32, 64, 8), (32, 128, 4), (16, 128, 2), (32, 64, 6)])
def test_tq_attention_row_is_batch_and_chunk_invariant(page_size, d, h):
    """GQA groups 1..4 (every row-tile shape of the score and value kernels), head_dim 64 and 128."""
    cache, q, bt, _, _ = tq_setup([45], [45], page_size=page_size, d=d, h=h)
    args = (cache.k_codes[0], cache.k_scales[0], cache.v_codes[0], cache.v_scales[0])
    rot, cents = cache.rotations[0], cache.centroids
    whole = CPU.tq_paged_attention(q, *args, bt, torch.tensor([0, 45], dtype=torch.int32),
                                   torch.tensor([45], dtype=torch.int32), rot, cents, 0.1)
    for pos in (0, 16, 44):
        one = CPU.tq_paged_attention(q[pos:pos + 1], *args, bt, torch.tensor([0, 1], dtype=torch.int32),
                                     torch.tensor([pos + 1], dtype=torch.int32), rot, cents, 0.1)
        assert torch.equal(one[0], whole[pos])


def test_tq_engine_concurrent_equals_solo(bf16_ckpt):
    eng = make_engine(bf16_ckpt, kv_cache="tq")
    prompts = [eng.tokenizer.encode(t) for t in ("Hello, world!", "The quick brown fox jumps over the lazy dog. " * 5,
                                                 "介绍一下北京故宫", "def f(x):\n    return x * 2\n" * 4, "a b c d e f g",
                                                 "Once upon a time", "1 2 3 4 5 6 7 8 9", "🫠🎉 emoji")]
    params = eng.make_params({"temperature": 0, "max_tokens": 24, "ignore_eos": True})
    solo = [eng.generate([p], params)[0]["output_ids"] for p in prompts]
    together = [r["output_ids"] for r in eng.generate(prompts, params)]
    assert together == solo
    assert eng.block_manager.num_used == 0


def test_kv_quality_report_tq_moves_logprobs_but_little(ckpts):
    """On a checkpoint with transformers' own init scale (0.02), as trained models are: the figure of the README."""
    import json
    import subprocess
    import sys

    from helpers import ROOT

    ckpt = ckpts.get("tiny-bf16-smooth", "bf16", initializer_range=0.02)
    proc = subprocess.run([sys.executable, "-m", "backend_lib.tools.kv_quality", "--checkpoint", str(ckpt),
                           "--page-size", "16", "--dtype", "float32", "--json"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\ntq vs bf16 KV ({r['tokens']} tokens): mean |delta logprob| {r['mean_abs_delta_logprob']:.4f}, "
          f"perplexity {r['perplexity_change_pct']:+.2f} %, top-1 agreement {100 * r['top1_agreement']:.1f} %")
    assert 0 < r["mean_abs_delta_logprob"] < 0.03
    assert abs(r["perplexity_change_pct"]) < 1.0
    assert r["top1_agreement"] > 0.95
    assert r["tokens_in_budget_tq"] / r["tokens_in_budget_bf16"] > 3.0   # head_dim 32 here: 3.2x; 3.76x at 128


def test_tq_engine_through_reference_kernels_matches_cpu(bf16_ckpt):
    a = make_engine(bf16_ckpt, kv_cache="tq")
    b = make_engine(bf16_ckpt, kv_cache="tq", kernels="reference")
    ids = a.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    da = torch.tensor(a.score(ids)[1:])
    db = torch.tensor(b.score(ids)[1:])
    assert (da - db).abs().max() < 2e-3


def test_tq_with_a8w8_weights(a8w8_ckpt):
    eng = make_engine(a8w8_ckpt, kv_cache="tq", dtype="bfloat16")
    prompts = [eng.tokenizer.encode(t) for t in ("Hello, world!", "The quick brown fox jumps over the lazy dog. " * 5,
                                                 "介绍一下北京故宫")]
    params = eng.make_params({"temperature": 0, "max_tokens": 16, "ignore_eos": True})
    solo = [eng.generate([p], params)[0]["output_ids"] for p in prompts]
    assert [r["output_ids"] for r in eng.generate(prompts, params)] == solo
    assert all(len(s) == 16 for s in solo)
