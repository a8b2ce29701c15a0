"""kernels: triton, proven on the CPU through Triton's interpreter (TRITON_INTERPRET=1): A8W8 bit-exact with the
reference, the float kernels within tolerance, attention rows bit-identical across whole prompts, chunks, decode
steps and batches, TurboQuant codes equal to the reference's, and the reference's exact greedy tokens end to end.
Small shapes: the interpreter runs numpy per program."""
from __future__ import annotations

import json
import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"      # before the kernels are defined: they run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="the triton package is not installed (pip install -e '.[test]')")

from backend_lib.kernels import get_kernels  # noqa: E402
from backend_lib.kernels import reference as ref  # noqa: E402
from backend_lib.kv_cache import tq_codec as codec  # noqa: E402
from helpers import ROOT, make_engine  # noqa: E402
from kernel_helpers import paged_setup, tq_setup  # noqa: E402

TRI = get_kernels("cpu", "triton")
DTYPES = [torch.float32, torch.bfloat16]


def test_the_triton_set_is_selected_and_refuses_a_cpu_without_the_interpreter(monkeypatch):
    assert TRI.name == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="CUDA"):
        get_kernels("cpu", "triton")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K", [(37, 101), (9, 1), (130, 67)])
def test_a8w8_linear_is_bit_exact_with_the_reference_at_every_m(N, K, dtype):
    g = torch.Generator().manual_seed(N * K)
    x = (torch.randn(64, K, generator=g) * 5).to(dtype)
    x[3] = -x[3].abs()                                   # a row whose extreme is negative
    x[5] = 0                                             # an all-zero row (scale guard)
    w_q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    w_q[0] = -128
    w_s = torch.rand(N, generator=g) * 0.01
    p = TRI.a8w8_prepare(w_q, w_s)
    for m in (1, 2, 3, 16, 17, 64):
        got = TRI.a8w8_linear(x[:m], p)
        assert got.dtype == dtype and torch.equal(got, ref.a8w8_linear(x[:m], w_q, w_s)), m


@pytest.mark.parametrize("wd", DTYPES)
def test_float_linear_keeps_the_weight_dtype_and_rows_are_batch_invariant(wd):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(17, 75, generator=g).to(wd)
    w = torch.randn(300, 75, generator=g).to(wd)
    p = TRI.float_prepare(w)
    assert p.dtype == wd
    y = TRI.float_linear(x, p, torch.float32)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, ref.float_linear(x, w, torch.float32), rtol=1e-5, atol=1e-4)
    for m in (1, 2, 3, 16):
        assert torch.equal(TRI.float_linear(x[:m], p, torch.float32), y[:m])
    assert torch.equal(TRI.float_linear(x[5:6], p, torch.float32)[0], y[5])
    torch.testing.assert_close(TRI.float_linear(x, p).float(), ref.float_linear(x, w).float(),
                               rtol=1e-5 if wd == torch.float32 else 1e-2, atol=1e-4)
    assert torch.equal(TRI.float_rows(p, torch.tensor([4, 0])), w[[4, 0]])


def _int4(n, k, group, seed, permuted):
    """A random canonical int4 weight (checkpoint/int4.py's Int4Weight fields): codes, fp32 scales that are not
    bf16 values (a weight rounded to bf16 would show), integer zeros 0..16 (GPTQ v1's range), perm or None."""
    g = torch.Generator().manual_seed(seed)
    groups = k // (group or k)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, groups, generator=g) * 0.05 + 1e-3
    zeros = torch.randint(0, 17, (n, groups), generator=g).float()
    perm = torch.randperm(k, generator=g) if permuted else None
    return codes, scales, zeros, perm


# (group, N, K): groups smaller than the interpreter's BLOCK_K (several per tile), equal to it, larger, and
# channel-wise over an odd K; N odd everywhere (the N edge), K odd (the last byte's unused high nibble)
W4_SHAPES = [(16, 37, 64), (32, 37, 96), (128, 19, 256), (None, 37, 101)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("permuted", [False, True])
@pytest.mark.parametrize("group,N,K", W4_SHAPES)
def test_w4a16_rows_are_batch_invariant_and_equal_the_float_gemm_over_the_reference_weight(group, N, K, permuted,
                                                                                          dtype):
    """A row alone, and in batches of 2, 3, 5, 9: the same bits. Exact: the float GEMM (same tiles, same fp32
    products and K order) over the reference's dequantized fp32 weight and x gathered by perm. Within fp32
    summation-order tolerance: the formula in fp64 (reference.w4a16_linear sums K in torch.mv's order)."""
    codes, scales, zeros, perm = _int4(N, K, group, N * K, permuted)
    x = (torch.randn(9, K, generator=torch.Generator().manual_seed(K)) * 2).to(dtype)
    p = TRI.w4a16_prepare(codes, scales, zeros, perm)
    assert p[0].dtype == torch.uint8 and p[0].shape == (N, (K + 1) // 2)          # packed: two codes a byte
    full = TRI.w4a16_linear(x, p)
    assert full.dtype == dtype and full.shape == (9, N)
    for lo, hi in ((0, 1), (4, 5), (8, 9), (0, 2), (3, 6), (1, 6), (0, 9)):
        assert torch.equal(TRI.w4a16_linear(x[lo:hi], p), full[lo:hi]), (lo, hi)
    w = ref.w4a16_dequantize(codes, scales, zeros)
    xs = x if perm is None else x[:, perm]
    assert torch.equal(full, TRI.float_linear(xs.contiguous(), w))
    expected = xs.double() @ w.double().t()
    reference = ref.w4a16_linear(x, ref.w4a16_prepare(codes, scales, zeros, perm))
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    for got in (full, reference):
        torch.testing.assert_close(got.double(), expected.to(dtype).double(), rtol=tol,
                                   atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("permuted", [False, True])
@pytest.mark.parametrize("group,N,K", W4_SHAPES)
def test_w4a16_dequantizes_in_registers_exactly_as_the_reference(group, N, K, permuted):
    """One-hot rows read the weight back (one nonzero product per output: no summation order), so the kernel's
    `(code - zero) * scale` must be the reference's fp32 value bit for bit: an FMA, a bf16-rounded weight, a
    wrong nibble, group or perm index would each change it."""
    codes, scales, zeros, perm = _int4(N, K, group, 7 * K, permuted)
    got = TRI.w4a16_linear(torch.eye(K), TRI.w4a16_prepare(codes, scales, zeros, perm))
    w = ref.w4a16_dequantize(codes, scales, zeros)
    inv = torch.arange(K) if perm is None else torch.argsort(perm)      # x[:, perm] of a one-hot row j
    assert torch.equal(got, w[:, inv].t())
    assert torch.equal(got, ref.w4a16_linear(torch.eye(K), ref.w4a16_prepare(codes, scales, zeros, perm)))


def test_w4a16_refuses_codes_out_of_range_and_an_input_of_the_wrong_width():
    codes, scales, zeros, _ = _int4(8, 64, 32, 0, False)
    with pytest.raises(ValueError, match="0..15"):
        TRI.w4a16_prepare(codes | 16, scales, zeros)
    with pytest.raises(ValueError, match="groups"):
        TRI.w4a16_prepare(codes[:, :63], scales, zeros)
    with pytest.raises(ValueError, match="perm"):
        TRI.w4a16_prepare(codes, scales, zeros, torch.arange(63))
    with pytest.raises(ValueError, match="columns"):
        TRI.w4a16_linear(torch.randn(2, 62), TRI.w4a16_prepare(codes, scales, zeros))


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_rope_and_silu_match_the_reference(dtype):
    g = torch.Generator().manual_seed(2)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    x, r = torch.randn(5, 100, generator=g).to(dtype), torch.randn(5, 100, generator=g).to(dtype)
    w = (torch.rand(100, generator=g) + 0.5).to(dtype)
    torch.testing.assert_close(TRI.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), **tol)
    out, h = TRI.add_rms_norm(x, r, w, 1e-6)
    rout, rh = ref.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(h, rh)
    torch.testing.assert_close(out, rout, **tol)
    gu = torch.randn(3, 2 * 96, generator=g).to(dtype)
    torch.testing.assert_close(TRI.silu_mul(gu), ref.silu_mul(gu), **tol)
    H, KVH, D = 4, 2, 32
    qkv = torch.randn(5, (H + 2 * KVH) * D, generator=g).to(dtype)
    qw, kw = (torch.rand(D, generator=g) + .5).to(dtype), (torch.rand(D, generator=g) + .5).to(dtype)
    pos, cs = torch.tensor([0, 3, 7, 100, 2]), ref.rotary_cos_sin(D, 128, 1e6)
    got = TRI.qk_norm_rope(qkv, qw, kw, pos, cs, H, KVH, 1e-6)
    for a, b in zip(got, ref.qk_norm_rope(qkv, qw, kw, pos, cs, H, KVH, 1e-6)):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, **tol)
    assert torch.equal(got[2], ref.qk_norm_rope(qkv, qw, kw, pos, cs, H, KVH, 1e-6)[2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H,KVH", [(4, 2), (16, 8), (5, 3)])
def test_qk_norm_rope_gives_a_head_the_same_bits_in_any_block_of_heads(monkeypatch, dtype, H, KVH):
    """A program takes a block of heads (norm.QK_HEADS): a head's q / k must be the bits of one head a program,
    whatever block it falls in and however many heads pad the last block."""
    from backend_lib.kernels.triton import norm

    D, T = 32, 3
    g = torch.Generator().manual_seed(H * 10 + KVH)
    qkv = (torch.randn(T, (H + 2 * KVH) * D, generator=g) * 3).to(dtype)
    qw, kw = (torch.rand(D, generator=g) + .5).to(dtype), (torch.rand(D, generator=g) + .5).to(dtype)
    pos, cs = torch.tensor([0, 9, 77]), ref.rotary_cos_sin(D, 128, 1e6)
    outs = []
    for hb in (1, 2, 8):
        monkeypatch.setattr(norm, "QK_HEADS", hb)
        outs.append(norm.qk_norm_rope(qkv, qw, kw, pos, cs, H, KVH, 1e-6))
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_matches_the_reference_across_prefill_chunks_and_decode(dtype, page_size):
    # decode at 50, a chunk of 20 over 13 cached tokens, a whole prompt of 40, GQA 3:1 (a padded head group)
    args = paged_setup(dtype, seq_lens=[50, 33, 40], q_lens=[1, 20, 40], page_size=page_size, kvh=2, h=6, d=32)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(TRI.paged_attention(*args, 0.125).float(), ref.paged_attention(*args, 0.125).float(),
                               rtol=tol, atol=tol)


def test_paged_attention_rows_are_identical_in_prompt_chunk_decode_and_any_batch():
    q, kc, vc, bt, _, _ = paged_setup(torch.bfloat16, seq_lens=[45, 45], q_lens=[45, 45], page_size=16, kvh=2, h=4,
                                       d=32)
    one_seq = bt[:1]
    whole = TRI.paged_attention(q[:45], kc, vc, one_seq, torch.tensor([0, 45], dtype=torch.int32),
                                torch.tensor([45], dtype=torch.int32), 0.1)
    chunk = TRI.paged_attention(q[30:45], kc, vc, one_seq, torch.tensor([0, 15], dtype=torch.int32),
                                torch.tensor([45], dtype=torch.int32), 0.1)
    assert torch.equal(chunk, whole[30:])
    for pos in (0, 15, 16, 31, 32, 44):     # across key blocks, pages and splits
        one = TRI.paged_attention(q[pos:pos + 1], kc, vc, one_seq, torch.tensor([0, 1], dtype=torch.int32),
                                  torch.tensor([pos + 1], dtype=torch.int32), 0.1)
        assert torch.equal(one[0], whole[pos]), pos
    # the same decode row next to other sequences (another's chunk before it, a decode after it)
    mixed = TRI.paged_attention(torch.cat([q[45:50], q[20:21], q[60:61]]), kc, vc, bt[[1, 0, 1]],
                                torch.tensor([0, 5, 6, 7], dtype=torch.int32),
                                torch.tensor([30, 21, 16], dtype=torch.int32), 0.1)
    assert torch.equal(mixed[5], whole[20])


class _Launches:
    """Counts the launches of a kernel (the module attribute replaced), passing them on."""

    def __init__(self, kernel):
        self.kernel, self.n = kernel, 0

    def __getitem__(self, grid):
        self.n += 1
        return self.kernel[grid]


def test_flash_decoding_splits_give_decode_rows_the_prefill_bits_in_any_batch(monkeypatch):
    """Decode over long contexts (several splits of SPLIT keys, each its own program, merged by combine_kernel):
    each row equals the same position in a whole prompt (where one program walks the splits), alone or beside
    other sequences of other lengths and a padding row, and agrees with the reference."""
    from backend_lib.kernels.triton import attention

    combine = _Launches(attention.combine_kernel)
    monkeypatch.setattr(attention, "combine_kernel", combine)
    S = attention.SPLIT
    lens = [3 * S + 5, S + 1, 2 * S]
    q, kc, vc, bt, _, _ = paged_setup(torch.bfloat16, seq_lens=lens, q_lens=lens, page_size=16, kvh=2, h=4, d=32)
    starts = [0, lens[0], lens[0] + lens[1]]
    def one_seq(i, rows, n_q, n):
        return TRI.paged_attention(rows, kc, vc, bt[i:i + 1], torch.tensor([0, n_q], dtype=torch.int32),
                                   torch.tensor([n], dtype=torch.int32), 0.1)
    whole = [one_seq(i, q[a:a + n], n, n) for i, (a, n) in enumerate(zip(starts, lens))]
    assert combine.n == 0                                    # prefill: the programs walk their splits
    pos = [3 * S + 4, S, 2 * S - 1]                          # the last position of each: 4, 2 and 2 splits
    alone = [one_seq(i, q[a + p:a + p + 1], 1, p + 1) for i, (a, p) in enumerate(zip(starts, pos))]
    assert combine.n == 3
    for i in range(3):
        assert torch.equal(alone[i][0], whole[i][pos[i]]), i
    # a batch in another order, with an earlier position of sequence 0 and a padding row (no keys)
    rows = [2, 0, 1, 0]
    ps = [pos[2], pos[0], pos[1], S + 3]
    qs = torch.cat([q[starts[r] + p:starts[r] + p + 1] for r, p in zip(rows, ps)] + [q[:1]])
    batch = TRI.paged_attention(qs, kc, vc, bt[rows + [0]], torch.arange(6, dtype=torch.int32),
                                torch.tensor([p + 1 for p in ps] + [0], dtype=torch.int32), 0.1)
    assert combine.n == 4
    for j, (r, p) in enumerate(zip(rows, ps)):
        assert torch.equal(batch[j], whole[r][p]), j
    assert not batch[4].any()
    ref_out = ref.paged_attention(q[pos[0]:pos[0] + 1], kc, vc, bt[:1], torch.tensor([0, 1], dtype=torch.int32),
                                  torch.tensor([pos[0] + 1], dtype=torch.int32), 0.1)
    torch.testing.assert_close(alone[0].float(), ref_out.float(), rtol=2e-2, atol=2e-2)


def test_the_set_owns_a_row_by_row_kv_layout_and_attends_over_it_like_the_reference():
    """Dense caches in the Triton set's layout ([P, KVH, S, D]) and in the blocked one, written through each set's
    write_kv from the same rows: the same attention (decode, a chunk over cached tokens, a prompt)."""
    from backend_lib.kv_cache import DenseKVCache
    from backend_lib.kv_cache.metadata import AttentionMetadata

    g = torch.Generator().manual_seed(3)
    kvh, h, d, page, n_pages = 2, 4, 32, 16, 10
    mine = DenseKVCache(1, n_pages, page, kvh, d, torch.bfloat16, torch.device("cpu"), TRI)
    theirs = DenseKVCache(1, n_pages, page, kvh, d, torch.bfloat16, torch.device("cpu"), ref.KERNELS)
    assert mine.k[0].shape == (n_pages, kvh, page, d) and theirs.k[0].dim() == 5
    lens, qlens = [40, 30, 17], [1, 10, 17]
    perm = torch.randperm(n_pages, generator=g).tolist()
    tables = torch.zeros(3, 3, dtype=torch.int32)
    for b, n in enumerate(lens):
        k = -(-n // page)
        tables[b, :k] = torch.tensor(perm[:k])
        perm = perm[k:]
        rows = torch.randn(n, kvh, d, generator=g).to(torch.bfloat16)
        slots = torch.tensor([int(tables[b, p // page]) * page + p % page for p in range(n)])
        TRI.write_kv(rows, rows.flip(-1), mine.k[0], mine.v[0], slots)
        ref.write_kv(rows, rows.flip(-1), theirs.k[0], theirs.v[0], slots)
    q = torch.randn(sum(qlens), h, d, generator=g).to(torch.bfloat16)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), block_tables=tables,
                             query_start_loc=torch.tensor([0, 1, 11, 28], dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32))
    got = mine.attend(0, q, meta, d ** -0.5)
    torch.testing.assert_close(got.float(), theirs.attend(0, q, meta, d ** -0.5).float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(got, TRI.paged_attention(q, theirs.k[0], theirs.v[0], tables, meta.query_start_loc,
                                                meta.seq_lens, d ** -0.5))       # the same bits from either layout


def _tq_pages(n, d, page_size=16):
    pages = -(-n // page_size)
    kw = page_size
    return (torch.zeros(pages, 1, page_size // kw, d // 2, kw, dtype=torch.uint8), torch.zeros(pages, 1, page_size),
            torch.zeros(pages, 1, page_size, d // 2, dtype=torch.uint8), torch.zeros(pages, 1, page_size))


@pytest.mark.parametrize("d", [32, 64])
def test_tq_write_codes_equal_the_reference(d):
    g = torch.Generator().manual_seed(d)
    n = 40
    x = torch.randn(n, 1, d, generator=g)
    rot = codec.tq_rotation(d, 5)
    cents, bounds = codec.tq_codebook(d)
    mine, theirs = _tq_pages(n, d), _tq_pages(n, d)
    slots = torch.randperm(48, generator=g)[:n]
    TRI.tq_write(x, x * 2, *mine, slots, rot, cents, bounds)
    ref.tq_write(x, x * 2, *theirs, slots, rot, cents, bounds)
    assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[2], theirs[2])
    assert mine[0].any()
    torch.testing.assert_close(mine[1], theirs[1], rtol=1e-6, atol=0)
    torch.testing.assert_close(mine[3], theirs[3], rtol=1e-6, atol=0)


def test_tq_attention_matches_the_reference_and_rows_are_invariant():
    cache, q, bt, qsl, lens = tq_setup([50, 33, 40], [1, 20, 40], d=32, kvh=2, h=4, page_size=16)
    args = (cache.k_codes[0], cache.k_scales[0], cache.v_codes[0], cache.v_scales[0])
    rot, cents = cache.rotations[0], cache.centroids
    got = TRI.tq_paged_attention(q, *args, bt, qsl, lens, rot, cents, 0.125)
    torch.testing.assert_close(got, ref.tq_paged_attention(q, *args, bt, qsl, lens, rot, cents, 0.125),
                               rtol=1e-4, atol=1e-5)
    whole = TRI.tq_paged_attention(q[21:61], *args, bt[2:], torch.tensor([0, 40], dtype=torch.int32),
                                   torch.tensor([40], dtype=torch.int32), rot, cents, 0.1)
    for pos in (0, 16, 39):     # 40 keys in 3 pages of 16: decode in split programs
        one = TRI.tq_paged_attention(q[21 + pos:22 + pos], *args, bt[2:], torch.tensor([0, 1], dtype=torch.int32),
                                     torch.tensor([pos + 1], dtype=torch.int32), rot, cents, 0.1)
        assert torch.equal(one[0], whole[pos]), pos


PROMPT = "Hello there, how are you doing today? The weather is fine and the sea is calm."


def _generate(ckpt, kernels, dtype, kv_cache):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "backend_lib.generate", "--checkpoint", str(ckpt),
                           "--kernels", kernels,
                           "--dtype", dtype, "--kv-cache", kv_cache, "--page-size", "16",
                           "--prompt", PROMPT, "--max-tokens", "6",
                           "--temperature", "0", "--ignore-eos", "--json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["output_ids"]


@pytest.mark.parametrize("dtype,kv_cache", [("bfloat16", "bf16"), ("bfloat16", "tq")])
def test_generate_with_kernels_triton_gives_the_reference_greedy_tokens(a8w8_ckpt, dtype, kv_cache):
    """The prompt spans two pages (16 tokens each), so decode reads a prefilled page and a page it writes."""
    got = _generate(a8w8_ckpt, "triton", dtype, kv_cache)
    assert len(got) == 6 and got == _generate(a8w8_ckpt, "reference", dtype, kv_cache)


def test_w4a16_engine_greedy_ids_batched_equal_solo(ckpts):
    """A tiny GPTQ desc_act (act-order perm, asymmetric, group 64) checkpoint through the Triton set's int4 GEMM:
    each prompt's greedy ids alone equal its ids in one batch of three. A 3,000-token vocabulary (prompts of ids
    below it): the interpreted head over Qwen3's 151,936 rows was most of the test's time, and it is not the int4
    GEMM under test."""
    eng = make_engine(ckpts.get("tiny-gptq-g64-asym-descact-v3000", "gptq", group_size=64, symmetric=False,
                                desc_act=True, vocab_size=3000),
                      kernels="triton", dtype="bfloat16", max_model_len=256, kv_cache_memory="8MiB")
    lin = eng.runner.model.layers[0].mlp.down_proj              # K = the intermediate size: several groups
    assert lin.prepared[0].dtype == torch.uint8 and lin.prepared[3] is not None     # packed, with its perm
    prompts = [[9, 2047, 13], [785, 2974, 1876, 835, 2208, 916, 279], [16, 11, 220, 17]]
    params = eng.make_params({"temperature": 0, "max_tokens": 5, "ignore_eos": True})
    solo = [eng.generate([p], params)[0]["output_ids"] for p in prompts]
    assert all(len(s) == 5 for s in solo) and [r["output_ids"] for r in eng.generate(prompts, params)] == solo
