"""Decode graphs per batch bucket (engine/cuda_graphs.py), proven on the CPU with capture off and the Triton set
interpreted: a step padded to its bucket gives the real rows the same bits as the unpadded step, and the
padding rows write nothing to the KV cache. (The capture itself needs a GPU.)"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"      # before the kernels are defined: they run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="the triton package is not installed (pip install -e '.[test]')")

from backend_lib.checkpoint import ModelConfig, parse_quantization_config  # noqa: E402
from backend_lib.config import EngineConfig  # noqa: E402
from backend_lib.engine.cuda_graphs import DecodeGraphs, buckets  # noqa: E402
from backend_lib.engine.model_runner import ModelRunner  # noqa: E402
from backend_lib.kernels import get_kernels  # noqa: E402


def test_buckets_double_up_to_max_num_seqs():
    assert buckets(1) == [1] and buckets(5) == [1, 2, 4, 8] and buckets(64) == [1, 2, 4, 8, 16, 32, 64]


def test_cuda_graphs_is_an_engine_parameter():
    assert EngineConfig(checkpoint="x").cuda_graphs is True
    assert EngineConfig.from_params({"checkpoint": "x", "cuda_graphs": "false"}).cuda_graphs is False


@pytest.mark.parametrize("kv_cache", ["bf16", "tq"])
def test_a_padded_decode_equals_the_unpadded_one_and_padding_writes_nothing(a8w8_ckpt, kv_cache):
    cfg = EngineConfig(checkpoint=str(a8w8_ckpt), page_size=16, kv_cache_memory="4MiB", max_num_seqs=4,
                       kv_cache=kv_cache)
    mc = ModelConfig.from_dir(str(a8w8_ckpt))
    runner = ModelRunner(cfg, mc, parse_quantization_config(mc.quantization_config), torch.device("cpu"),
                         torch.bfloat16, get_kernels("cpu", "triton"), 64)
    assert runner.graphs is None                          # on the CPU the engine decodes eagerly
    graphs = DecodeGraphs(runner, cfg.max_num_seqs, 4, capture=False)
    ids = torch.tensor([11, 22, 33])
    tables = torch.tensor([[1, 2], [3, 4], [5, 0]], dtype=torch.int32)   # page 0: no real row's
    cached = torch.tensor([5, 17, 2], dtype=torch.int32)
    with torch.inference_mode():
        unpadded = runner.decode_logits(ids, tables, cached)
        state = [t.clone() for t in vars(runner.kv_cache).values() if isinstance(t, list) for t in t]
        padded, aux = graphs.run(ids, tables, cached)     # bucket 4: one padding row
    assert padded.shape == unpadded.shape and torch.equal(padded, unpadded) and aux is None   # no aux layers
    after = [t for t in vars(runner.kv_cache).values() if isinstance(t, list) for t in t]
    assert len(after) == len(state) and all(torch.equal(a, b) for a, b in zip(after, state))
    assert all(not t[0].any() for t in after if t.dim() >= 3)   # page 0 never written


def test_a_padded_moe_decode_equals_the_unpadded_one(moe_a8w8_ckpt):
    """Qwen3-MoE through the fused Triton MoE (no host read, so capturable): a padding row routes to experts of
    its own and shares their blocks, yet the real rows keep their bits."""
    from backend_lib.kernels.triton.experts import PackedExperts

    cfg = EngineConfig(checkpoint=str(moe_a8w8_ckpt), page_size=16, kv_cache_memory="4MiB", max_num_seqs=4)
    mc = ModelConfig.from_dir(str(moe_a8w8_ckpt))
    runner = ModelRunner(cfg, mc, parse_quantization_config(mc.quantization_config), torch.device("cpu"),
                         torch.bfloat16, get_kernels("cpu", "triton"), 64)
    assert any(isinstance(m, PackedExperts) for m in runner.model.modules())
    graphs = DecodeGraphs(runner, cfg.max_num_seqs, 4, capture=False)
    ids = torch.tensor([11, 22, 33])
    tables = torch.tensor([[1, 2], [3, 4], [5, 0]], dtype=torch.int32)
    cached = torch.tensor([5, 17, 2], dtype=torch.int32)
    with torch.inference_mode():
        unpadded = runner.decode_logits(ids, tables, cached)
        padded, _ = graphs.run(ids, tables, cached)
    assert padded.shape == unpadded.shape and torch.equal(padded, unpadded)
