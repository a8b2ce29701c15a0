"""The npu kernel set against the reference, through emulations of the torch_npu ops written from their documented
semantics (tests/npu_emulation.py): the set has not run on an NPU; these tests pin what it sends each op."""
from __future__ import annotations

import pytest
import torch

import npu_emulation
from backend_lib.kernels import get_kernels
from backend_lib.kernels import reference as ref
from backend_lib.kernels.npu import kernel_set
from backend_lib.kv_cache import DenseKVCache
from backend_lib.kv_cache.metadata import AttentionMetadata

NPU = kernel_set(npu_emulation)
DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a8w8_quantizes_like_the_reference_and_stays_within_one_rounding(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(17, 101, generator=g) * 4).to(dtype)
    w_q = torch.randint(-128, 128, (37, 101), generator=g, dtype=torch.int8)
    w_s = torch.rand(37, generator=g) * 0.01
    q, s = npu_emulation.npu_dynamic_quant(x)
    rq, rs = ref.quantize_per_token(x)
    assert torch.equal(q, rq) and torch.equal(s, rs[:, 0])
    got = NPU.a8w8_linear(x, NPU.a8w8_prepare(w_q, w_s))
    assert got.dtype == dtype and got.shape == (17, 37)
    torch.testing.assert_close(got.float(), ref.a8w8_linear(x, w_q, w_s).float(), rtol=8e-3, atol=1e-6)
    assert NPU.a8w8_prepare(w_q, w_s)[0].shape == (101, 37)        # npu_quant_matmul's x2 is [K, N]


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_and_swiglu_match_the_reference(dtype):
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(5, 64, generator=g).to(dtype), torch.randn(5, 64, generator=g).to(dtype)
    w = (torch.rand(64, generator=g) + 0.5).to(dtype)
    torch.testing.assert_close(NPU.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), rtol=1e-2, atol=1e-2)
    y, h = NPU.add_rms_norm(x, r, w, 1e-6)
    ry, rh = ref.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(h, rh)
    torch.testing.assert_close(y, ry, rtol=1e-2, atol=1e-2)
    gu = torch.randn(3, 96, generator=g).to(dtype)
    torch.testing.assert_close(NPU.silu_mul(gu), ref.silu_mul(gu), rtol=1e-2, atol=1e-2)


def test_the_set_owns_its_kv_layout_and_attention_matches_the_reference_over_it():
    """Both caches written through their own set's write_kv from the same rows; decode, a chunk over cached
    tokens and a whole prompt in one step, GQA 2:1, pages scattered."""
    g = torch.Generator().manual_seed(2)
    kvh, h, d, page, n_pages = 2, 4, 32, 16, 12
    npu_cache = DenseKVCache(1, n_pages, page, kvh, d, torch.bfloat16, torch.device("cpu"), NPU)
    ref_cache = DenseKVCache(1, n_pages, page, kvh, d, torch.bfloat16, torch.device("cpu"), ref.KERNELS)
    assert npu_cache.k[0].shape == (n_pages, page, kvh, d) and ref_cache.k[0].dim() == 5
    lens, qlens = [40, 30, 20], [1, 10, 20]
    perm = torch.randperm(n_pages, generator=g).tolist()
    tables = torch.zeros(3, 3, dtype=torch.int32)
    for b, n in enumerate(lens):
        k = -(-n // page)
        tables[b, :k] = torch.tensor(perm[:k])
        perm = perm[k:]
        rows = torch.randn(n, kvh, d, generator=g).to(torch.bfloat16)
        slots = torch.tensor([int(tables[b, p // page]) * page + p % page for p in range(n)])
        for kernels, cache in ((NPU, npu_cache), (ref.KERNELS, ref_cache)):
            kernels.write_kv(rows, rows.flip(-1), cache.k[0], cache.v[0], slots)
    q = torch.randn(sum(qlens), h, d, generator=g).to(torch.bfloat16)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), block_tables=tables,
                             query_start_loc=torch.tensor([0, 1, 11, 31], dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32))
    got = npu_cache.attend(0, q, meta, d ** -0.5)
    torch.testing.assert_close(got.float(), ref_cache.attend(0, q, meta, d ** -0.5).float(), rtol=2e-2, atol=2e-2)


def test_the_npu_layout_refuses_a_page_size_its_attention_cannot_take():
    with pytest.raises(ValueError, match="multiple of 16"):
        NPU.kv_shapes(4, 8, 2, 32)


def test_get_kernels_npu_is_asked_for_and_refuses_other_devices():
    with pytest.raises(RuntimeError, match="Ascend"):
        get_kernels("cpu", "npu")
