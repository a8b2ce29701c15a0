"""Every optimized kernel against its pure-PyTorch reference, and batch invariance."""
from __future__ import annotations

import pytest
import torch

from backend_lib.kernels import REFERENCE, get_kernels
from backend_lib.kernels import reference as ref
from kernel_helpers import paged_setup

CPU = get_kernels("cpu")
DTYPES = [torch.float32, torch.bfloat16]


def test_cpu_kernels_are_compiled():
    assert CPU.name == "cpu", "the C++ CPU kernels did not build; the suite would only test the reference"


@pytest.mark.parametrize("xd", DTYPES)
@pytest.mark.parametrize("wd", DTYPES)
def test_float_linear_matches_reference_and_is_batch_invariant(xd, wd):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 1000, generator=g).to(xd)   # K not a multiple of 16 or 32: exercises the tails
    w = torch.randn(259, 1000, generator=g).to(wd)  # N not a multiple of 4: a partial tile
    p = CPU.float_prepare(w)
    y = CPU.float_linear(x, p, torch.float32)
    r = ref.float_linear(x, w, torch.float32)
    torch.testing.assert_close(y, r, rtol=1e-4, atol=2e-3)
    for m in (1, 2, 3, 5, 17):
        assert torch.equal(CPU.float_linear(x[:m], p, torch.float32), y[:m])
    assert torch.equal(CPU.float_linear(x[9:10], p, torch.float32)[0], y[9])
    assert CPU.float_linear(x, p).dtype == xd
    ids = torch.tensor([0, 3, 4, 258, 7, 3])
    assert torch.equal(CPU.float_rows(p, ids), w[ids])


@pytest.mark.parametrize("wd", DTYPES)
@pytest.mark.parametrize("K", [7, 1001])
def test_float_linear_odd_k_and_every_row_tile(wd, K):
    """Odd K (the padded k-pair), N off the panel width, M across every row-tile size 1..13."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(13, K, generator=g).to(torch.bfloat16)
    w = torch.randn(70, K, generator=g).to(wd)
    p = CPU.float_prepare(w)
    y = CPU.float_linear(x, p, torch.float32)
    torch.testing.assert_close(y, ref.float_linear(x, w, torch.float32), rtol=1e-4, atol=2e-3)
    for m in range(1, 13):
        assert torch.equal(CPU.float_linear(x[:m], p, torch.float32), y[:m])
    for i in (0, 6, 12):
        assert torch.equal(CPU.float_linear(x[i:i + 1], p, torch.float32)[0], y[i])
    assert torch.equal(CPU.float_linear(x, p), y.to(torch.bfloat16))   # the bf16 store rounds like torch


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_fused_add(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 3, 128, generator=g).to(dtype)
    r = torch.randn(9, 3, 128, generator=g).to(dtype)
    w = torch.randn(128, generator=g).to(dtype)
    torch.testing.assert_close(CPU.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    out, h = CPU.add_rms_norm(x, r, w, 1e-6)
    rout, rh = ref.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(h, rh)
    torch.testing.assert_close(out, rout, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)


@pytest.mark.parametrize("page_size", [16, 32])   # key blocks of 16 and of 32
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_prefill_and_decode_across_pages_with_gqa(dtype, page_size):
    # sequence 0: decode at 50 tokens; 1: a prefill chunk of 20 on top of 13 cached; 2: whole prompt of 40;
    # 3: a long prompt in one chunk (row blocks of several query positions)
    args = paged_setup(dtype, seq_lens=[50, 33, 40, 100], q_lens=[1, 20, 40, 100], page_size=page_size)
    out = CPU.paged_attention(*args, 0.125)
    exp = ref.paged_attention(*args, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), exp.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("page_size", [16, 32])
def test_paged_attention_row_is_identical_in_chunk_prefill_and_decode(page_size):
    q, kc, vc, bt, _, _ = paged_setup(torch.float32, seq_lens=[45], q_lens=[45], page_size=page_size)
    whole = CPU.paged_attention(q, kc, vc, bt, torch.tensor([0, 45], dtype=torch.int32),
                                torch.tensor([45], dtype=torch.int32), 0.1)
    # the same rows computed as a chunk (rows 30..44) and as single decode steps
    chunk = CPU.paged_attention(q[30:], kc, vc, bt, torch.tensor([0, 15], dtype=torch.int32),
                                torch.tensor([45], dtype=torch.int32), 0.1)
    assert torch.equal(chunk, whole[30:])
    for pos in (0, 15, 16, 44):
        one = CPU.paged_attention(q[pos:pos + 1], kc, vc, bt, torch.tensor([0, 1], dtype=torch.int32),
                                  torch.tensor([pos + 1], dtype=torch.int32), 0.1)
        assert torch.equal(one[0], whole[pos])


@pytest.mark.parametrize("group,d", [(1, 128), (2, 128), (3, 64), (6, 64), (8, 128)])
def test_paged_attention_gqa_groups_match_reference_and_rows_are_invariant(group, d):
    """Every row-tile shape of the score and value kernels (1..16 rows per block, head_dim 64 and 128):
    against the reference, and each position alone (a decode step) equals it inside the whole prompt."""
    kvh = 2
    q, kc, vc, bt, qsl, lens = paged_setup(torch.bfloat16, seq_lens=[37], q_lens=[37], kvh=kvh, h=kvh * group,
                                            d=d, page_size=32)
    whole = CPU.paged_attention(q, kc, vc, bt, qsl, lens, 0.1)
    torch.testing.assert_close(whole.float(), ref.paged_attention(q, kc, vc, bt, qsl, lens, 0.1).float(),
                               rtol=2e-2, atol=2e-2)
    for pos in (0, 7, 31, 32, 36):
        one = CPU.paged_attention(q[pos:pos + 1], kc, vc, bt, torch.tensor([0, 1], dtype=torch.int32),
                                  torch.tensor([pos + 1], dtype=torch.int32), 0.1)
        assert torch.equal(one[0], whole[pos])


def test_a8w8_linear_equals_independent_emulation_and_differs_from_weight_only():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(24, 256, generator=g) * torch.rand(24, 1, generator=g) * 4).to(torch.bfloat16)
    x[5] = 0  # an all-zero row must not divide by zero
    w = torch.randn(96, 256, generator=g) * 0.05
    w_scale = w.abs().amax(1) / 127.5
    w_q = torch.clamp(torch.round(w / w_scale[:, None]), -128, 127).to(torch.int8)
    # independent emulation, written out longhand from the spec
    xf = x.float()
    a = xf.abs().max(dim=1).values
    s = torch.where(a == 0, torch.ones_like(a), a / 127)
    q_emul = torch.clamp(torch.round(xf / s[:, None]), -128, 127).to(torch.int8)
    acc = (q_emul.long() @ w_q.long().t())                 # exact integer accumulation
    y_emul = acc.double() * s.double()[:, None] * w_scale.double()[None, :]
    for k in (CPU, REFERENCE):
        q_k, s_k = ref.quantize_per_token(x)
        assert torch.equal(q_k, q_emul), "int8 activations must be identical"
        y = k.a8w8_linear(x, k.a8w8_prepare(w_q, w_scale))
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.double(), y_emul.to(torch.bfloat16).double(), rtol=8e-3, atol=1e-6)
        assert torch.all(y[5] == 0)
    weight_only = ref.float_linear(x.float(), w_q.float() * w_scale[:, None]).to(torch.bfloat16)
    y = CPU.a8w8_linear(x, CPU.a8w8_prepare(w_q, w_scale))
    assert (y.float() - weight_only.float()).abs().max() > 1e-3, "activation quantization had no effect"


@pytest.mark.parametrize("dtype", DTYPES)
def test_a8w8_linear_matches_reference_bitwise_and_is_batch_invariant(dtype):
    """Small batches take the VNNI kernel, large ones oneDNN: integer accumulation makes both exact."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(70, 1000, generator=g) * 3).to(dtype)   # K not a multiple of 64: masked tails
    w_q = torch.randint(-128, 128, (301, 1000), generator=g, dtype=torch.int8)
    w_s = torch.rand(301, generator=g) * 0.01
    prepared = CPU.a8w8_prepare(w_q, w_s)
    full = CPU.a8w8_linear(x, prepared)
    assert torch.equal(full, ref.a8w8_linear(x, w_q, w_s))
    for m in (1, 2, 3, 4, 5, 16, 17, 33):
        assert torch.equal(CPU.a8w8_linear(x[:m], prepared), full[:m])


@pytest.mark.parametrize("K", [1, 7, 8, 9, 1001])
@pytest.mark.parametrize("N", [1, 9, 37])
def test_a8w8_linear_tails_and_row_tiles_are_exact(K, N):
    """Odd K (k-group and vector tails), N off the panel width, M across every row-tile size 1..13, and 30 rows
    (enough for the AVX2 kernel to widen each weight panel once)."""
    g = torch.Generator().manual_seed(7 + K + N)
    x = torch.randn(30, K, generator=g) * 5
    x[3] = -x[3].abs()                       # a row whose extreme is negative: q = -127 at its max
    w_q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    w_q[0] = -128                            # the int8 extremes must accumulate exactly
    w_s = torch.rand(N, generator=g) * 0.01
    prepared = CPU.a8w8_prepare(w_q, w_s)
    for dtype in DTYPES:
        xd = x.to(dtype)
        full = CPU.a8w8_linear(xd, prepared)
        assert torch.equal(full, ref.a8w8_linear(xd, w_q, w_s))
        for m in range(1, 13):
            assert torch.equal(CPU.a8w8_linear(xd[:m], prepared), full[:m])
        for i in (0, 5, 12):                 # a row alone equals the same row inside the batch
            assert torch.equal(CPU.a8w8_linear(xd[i:i + 1], prepared)[0], full[i])


class _NoIntegerMatmul(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails any matmul on integer operands: CUDA and NPU have none, so the reference must not use one."""

    MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_int_mm", "matmul", "dot", "mv"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.MATMULS:
            dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor)}
            assert not dtypes & {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8}, (func, dtypes)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("K", [1, 2, 1023, 1024, 1025, 3000])
def test_reference_int8_matmul_is_exact_without_an_integer_matmul(K):
    """Exact against an int64 sum of products (the -128 extremes make a 1024-chunk sum reach 2**24), at K across
    the 1024 chunk edge, and no integer matmul runs (the reference must run on CUDA and NPU)."""
    g = torch.Generator().manual_seed(K)
    q = torch.randint(-128, 128, (5, K), generator=g, dtype=torch.int8)
    w = torch.randint(-128, 128, (3, K), generator=g, dtype=torch.int8)
    q[0], w[0] = -128, -128                  # +2**14 per product: the largest sum a chunk can hold
    q[1], w[1, :] = 127, -128
    exact = (q.long()[:, None, :] * w.long()[None, :, :]).sum(-1)
    with _NoIntegerMatmul():
        got = ref.int8_matmul(q, w)
        y = ref.a8w8_linear(torch.randn(5, K, generator=g), w, torch.rand(3, generator=g))
    assert got.dtype == torch.int32 and torch.equal(got.long(), exact)
    assert got[0, 0] == K * 2**14 and y.shape == (5, 3)


def test_quantize_rounds_half_to_even_and_uses_minus_128_never():
    x = torch.tensor([[127.0, 0.5, 1.5, -2.5, -127.0, 63.5]])
    q, s = ref.quantize_per_token(x)
    assert s.item() == 1.0
    assert q.tolist() == [[127, 0, 2, -2, -127, 64]]


def test_rotary_matches_transformers_formula():
    from backend_lib.kernels.reference import rotary_cos_sin
    d, theta = 32, 1e6
    cs = rotary_cos_sin(d, 64, theta)
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(5, 4, d, generator=g), torch.randn(5, 2, d, generator=g)
    pos = torch.tensor([0, 1, 7, 31, 63])
    rq, rk = ref.rotary(q, k, pos, cs)
    inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    rot = lambda t: torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1)
    torch.testing.assert_close(rq, q * cos + rot(q) * sin)
    torch.testing.assert_close(rk, k * cos + rot(k) * sin)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_qk_norm_rope_and_silu_mul_match_reference(dtype):
    from backend_lib.kernels.reference import rotary_cos_sin
    g = torch.Generator().manual_seed(6)
    H, KVH, D = 8, 2, 64
    qkv = torch.randn(11, (H + 2 * KVH) * D, generator=g).to(dtype)
    qw, kw = torch.rand(D, generator=g).to(dtype) + 0.5, torch.rand(D, generator=g).to(dtype) + 0.5
    cs = rotary_cos_sin(D, 100, 1e6)
    pos = torch.tensor([0, 1, 2, 5, 9, 17, 33, 50, 64, 98, 99])
    got = CPU.qk_norm_rope(qkv, qw, kw, pos, cs, H, KVH, 1e-6)
    exp = ref.qk_norm_rope(qkv, qw, kw, pos, cs, H, KVH, 1e-6)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    for a, b in zip(got, exp):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, **tol)
    assert torch.equal(got[2], exp[2])
    one = CPU.qk_norm_rope(qkv[4:5], qw, kw, pos[4:5], cs, H, KVH, 1e-6)
    assert all(torch.equal(a[0], b[4]) for a, b in zip(one, got))
    x = torch.randn(7, 2 * 96, generator=g).to(dtype) * 3
    torch.testing.assert_close(CPU.silu_mul(x), ref.silu_mul(x), **tol)
    assert torch.equal(CPU.silu_mul(x[2:3])[0], CPU.silu_mul(x)[2])
