"""Warm-up before the KV pool is sized (engine/warmup.py): the sizing from free memory and the warm-up's activation
peak, and the CUDA code path run on the CPU with a fake memory reader: one prefill of max_num_batched_tokens and one
decode of max_num_seqs rows run first, and the pool is sized from what the reader says is free afterwards."""
from __future__ import annotations

import pytest
import torch

from backend_lib.checkpoint import ModelConfig, parse_quantization_config
from backend_lib.config import EngineConfig
from backend_lib.engine import model_runner, warmup
from backend_lib.engine.model_runner import ModelRunner
from backend_lib.kernels import REFERENCE
from backend_lib.kv_cache.base import cache_class

MiB = 2**20


def test_the_pool_takes_its_share_of_what_is_free_less_the_activations():
    assert warmup.kv_budget_after_warmup(0.5, 1000 * MiB, 200 * MiB) == 400 * MiB
    assert warmup.kv_budget_after_warmup("100MiB", 1000 * MiB, 200 * MiB) == 100 * MiB
    assert warmup.kv_budget_after_warmup("2GiB", 1000 * MiB, 200 * MiB) == 800 * MiB   # capped by what is free
    assert warmup.kv_budget_after_warmup(0.9, 100 * MiB, 300 * MiB) == 0


class FakeMemory:
    """A device whose weights take 100 MiB; the warm-up cache's bytes count as allocated; every model forward
    and sampler pass holds `step` MiB at its peak; the device has `total` MiB."""

    def __init__(self, total=2000, step=150):
        self.total, self.step = total * MiB, step * MiB
        self.alloc, self.top, self.calls = 100 * MiB, 100 * MiB, []

    def free(self):
        self.calls.append("free")
        return self.total - self.alloc

    def allocated(self):
        return self.alloc

    def peak(self):
        return self.top

    def reset_peak(self):
        self.calls.append("reset")
        self.top = self.alloc

    def release_cached(self):
        self.calls.append("release")

    def hold(self, nbytes):    # an allocation that stays (the warm-up cache), or a step's transient peak
        self.alloc += nbytes
        self.top = max(self.top, self.alloc)

    def spike(self):
        self.top = max(self.top, self.alloc + self.step)


@pytest.mark.parametrize("budget, expect_mib", [(0.5, (2000 - 100 - 150) // 2), ("64MiB", 64), ("8GiB", 2000 - 250)])
def test_the_runner_warms_up_then_sizes_the_pool_from_free_memory(bf16_ckpt, monkeypatch, budget, expect_mib):
    mem = FakeMemory()
    cfg = EngineConfig(checkpoint=str(bf16_ckpt), page_size=16, kv_cache_memory=budget, max_num_seqs=3,
                       max_num_batched_tokens=40)
    mc = ModelConfig.from_dir(str(bf16_ckpt))
    steps = []
    real_cls = cache_class(cfg.kv_cache)

    class CountedCache(real_cls):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            if "pool" in steps:
                return
            steps.append(("cache", a[1]))
            mem.hold(50 * MiB)

    monkeypatch.setattr(warmup, "cache_class", lambda kind: CountedCache)
    from backend_lib.models import Qwen3ForCausalLM
    real_forward = Qwen3ForCausalLM.forward

    def forward(self, input_ids, positions, kv_cache, meta):
        steps.append(("forward", int(input_ids.shape[0]), int(meta.seq_lens.shape[0])))
        mem.spike()
        return real_forward(self, input_ids, positions, kv_cache, meta)

    monkeypatch.setattr(Qwen3ForCausalLM, "forward", forward)
    real_sample = warmup.sample

    def sample(logits, seqs):
        steps.append(("sample", int(logits.shape[0]), max(s.params.logprobs for s in seqs)))
        mem.spike()
        return real_sample(logits, seqs)

    monkeypatch.setattr(warmup, "sample", sample)
    real_alloc = model_runner.allocate_kv_cache

    def alloc(*a, nbytes=None, **kw):
        steps.append("pool")
        steps.append(("nbytes", nbytes))
        return real_alloc(*a, nbytes=nbytes, **kw)

    monkeypatch.setattr(model_runner, "allocate_kv_cache", alloc)

    def release():        # the warm-up cache is gone by the time the free memory is read
        mem.calls.append("release")
        if ("cache", 4) in steps and "pool" not in steps:
            mem.alloc = 100 * MiB
    mem.release_cached = release

    runner = ModelRunner(cfg, mc, parse_quantization_config(mc.quantization_config), torch.device("cpu"),
                         torch.float32, REFERENCE, 128, memory=mem)
    # pages for the prefill (40 tokens: 3) or the decode (3 rows), plus one
    assert steps[:5] == [("cache", 4), ("forward", 40, 1), ("forward", 3, 3), ("sample", 3, 20), "pool"]
    assert mem.calls == ["release", "reset", "release", "free"]       # free memory read after the warm-up
    assert steps[5] == ("nbytes", expect_mib * MiB)
    per_page = real_cls.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, torch.float32) * 16
    assert runner.kv_cache.num_pages == min(expect_mib * MiB // per_page, 3 * (128 // 16))


def test_the_cpu_runner_does_not_warm_up(bf16_ckpt, monkeypatch):
    monkeypatch.setattr(model_runner, "warm_up", lambda *a: pytest.fail("warmed up on the CPU"))
    cfg = EngineConfig(checkpoint=str(bf16_ckpt), page_size=16, kv_cache_memory="4MiB", max_num_seqs=2)
    mc = ModelConfig.from_dir(str(bf16_ckpt))
    ModelRunner(cfg, mc, None, torch.device("cpu"), torch.float32, REFERENCE, 64)
