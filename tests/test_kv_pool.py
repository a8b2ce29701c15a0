"""KV page pool: memory budgets, the one-sequence floor and halving on allocation failure."""
from __future__ import annotations

import pytest
import torch

from backend_lib.checkpoint import ModelConfig
from backend_lib.kernels import REFERENCE
from backend_lib.kv_cache import KV_CACHES, BlockManager
from backend_lib.kv_cache.pool import allocate_kv_cache, parse_memory_budget

CFG = ModelConfig.from_dicts({"model_type": "qwen3", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
                              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                              "head_dim": 32})
PER_PAGE = 2 * 2 * 2 * 32 * 4 * 16  # K+V, layers, kv heads, head_dim, fp32 bytes, 16 tokens


def test_budget_parsing():
    assert parse_memory_budget("2GiB") == 2 * 2**30
    assert parse_memory_budget("512MB") == 512 * 10**6
    assert parse_memory_budget(0.25) == 0.25 and parse_memory_budget("0.5") == 0.5
    assert parse_memory_budget(4096) == 4096
    for bad in ("lots", "-1", "3 parsecs", 0):
        with pytest.raises(ValueError, match="kv_cache_memory"):
            parse_memory_budget(bad)


def test_pool_is_capped_by_what_can_be_used_and_floored_by_one_sequence():
    c = allocate_kv_cache("bf16", CFG, torch.float32, torch.device("cpu"), REFERENCE, "1GiB", 16, 64, 2)
    assert c.num_pages == 2 * 4
    with pytest.raises(ValueError, match="kv_cache_memory.*max_model_len=640"):
        allocate_kv_cache("bf16", CFG, torch.float32, torch.device("cpu"), REFERENCE, PER_PAGE * 10, 16, 640, 2)


def test_allocation_failure_halves_and_retries(monkeypatch):
    real = KV_CACHES["bf16"]
    attempts = []

    class Flaky(real):
        def __init__(self, num_layers, num_pages, *args, **kw):
            attempts.append(num_pages)
            if num_pages > 50:
                super().__init__(num_layers, 1, *args, **kw)   # a partial allocation, then the failure
                raise RuntimeError("out of memory")
            super().__init__(num_layers, num_pages, *args, **kw)

    monkeypatch.setitem(KV_CACHES, "bf16", Flaky)
    c = allocate_kv_cache("bf16", CFG, torch.float32, torch.device("cpu"), REFERENCE, PER_PAGE * 200, 16, 64, 100)
    assert attempts == [200, 100, 50] and c.num_pages == 50


def test_block_manager_grow_and_free():
    bm = BlockManager(4, 16)
    table: list[int] = []
    bm.grow(table, 17)
    assert len(table) == 2 and bm.num_used == 2
    assert bm.can_grow(table, 64) and not bm.can_grow(table, 65)
    with pytest.raises(RuntimeError):
        bm.grow(table, 100)
    bm.free(table)
    assert table == [] and bm.num_free == 4
