"""Support code of the kernel tests (not a test module): random paged-attention inputs, for the dense and the
TurboQuant caches, shared by the CPU, reference and Triton kernel tests."""
from __future__ import annotations

import torch

from backend_lib.kernels import get_kernels
from backend_lib.kernels import reference as ref
from backend_lib.kv_cache.layout import key_block_width
from backend_lib.kv_cache.turboquant import TurboQuantKVCache

CPU = get_kernels("cpu")


def scattered_tables(seq_lens, q_lens, page_size, n_pages, g):
    """Each sequence's pages drawn from one random permutation of the pool (scattered, not contiguous): the padded
    block table [B, max pages] int32, the pages per sequence and the query offsets."""
    perm = torch.randperm(n_pages, generator=g).tolist()
    tables, qsl = [], [0]
    for n, q in zip(seq_lens, q_lens):
        k = -(-n // page_size)
        tables.append(perm[:k])
        perm = perm[k:]
        qsl.append(qsl[-1] + q)
    bt = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    return bt, tables, qsl


def paged_setup(dtype, seq_lens, q_lens, page_size=16, kvh=2, h=8, d=64, seed=0):
    """Queries and a blocked, scattered dense KV cache: (q, k_cache, v_cache, block_table, query_start_loc,
    seq_lens)."""
    g = torch.Generator().manual_seed(seed)
    n_pages = sum(-(-n // page_size) for n in seq_lens) + 3
    kw = key_block_width(page_size)
    k_cache = torch.randn(n_pages, kvh, page_size // kw, d, kw, generator=g).to(dtype)   # blocked K
    v_cache = torch.randn(n_pages, kvh, page_size, d, generator=g).to(dtype)
    bt, _, qsl = scattered_tables(seq_lens, q_lens, page_size, n_pages, g)
    q = torch.randn(qsl[-1], h, d, generator=g).to(dtype)
    return q, k_cache, v_cache, bt, torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)


def tq_setup(seq_lens, q_lens, d=64, kvh=2, h=8, page_size=16, seed=0):
    """A TurboQuant cache filled with random K/V rows, and queries: (cache, q, block_table, query_start_loc,
    seq_lens)."""
    g = torch.Generator().manual_seed(seed)
    n_pages = sum(-(-n // page_size) for n in seq_lens) + 2
    cache = TurboQuantKVCache(1, n_pages, page_size, kvh, d, torch.float32, torch.device("cpu"), CPU, seed=3)
    bt, tables, qsl = scattered_tables(seq_lens, q_lens, page_size, n_pages, g)
    for i, t in enumerate(tables):
        slots = torch.tensor([t[p // page_size] * page_size + p % page_size for p in range(seq_lens[i])])
        kv = torch.randn(seq_lens[i], kvh, d, generator=g)
        ref.tq_write(kv, kv.flip(-1) * 2, cache.k_codes[0], cache.k_scales[0], cache.v_codes[0], cache.v_scales[0],
                     slots, cache.rotations[0], cache.centroids, cache.boundaries)
    q = torch.randn(qsl[-1], h, d, generator=g)
    return cache, q, bt, torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
