"""`int4_activations: int8`: an int4 checkpoint's attention projections and dense MLPs as W4A8Linear (the
checkpoint's own codes and scales on per-token int8 activations, kernels/reference/w4a8.py's arithmetic); what it
loads, what it refuses (naming the field and the tensor), and its cost in accuracy against W4A16. The decode
region's bits against the Python loop are tests/test_layer_loop.py's."""
from __future__ import annotations

import pytest
import torch

from helpers import make_engine

from backend_lib.checkpoint import ModelConfig, WeightStore, parse_quantization_config
from backend_lib.checkpoint.int4 import read_int4


def _linears(eng):
    return [(i, name, lin) for i, layer in enumerate(eng.runner.model.layers)
            for name, lin in (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                              ("gate_up", getattr(layer.mlp, "gate_up_proj", None)),
                              ("down", getattr(layer.mlp, "down_proj", None))) if lin is not None]


@pytest.mark.parametrize("kernels", ["cpu", "reference"])
def test_the_checkpoints_own_codes_on_int8_activations(ckpts, kernels):
    """Every attention projection and dense MLP of a W4A16 checkpoint is a W4A8Linear holding the checkpoint's
    codes and scales (q, k, v fused in that order); the CPU set's linears give the reference set's bits; the
    logits stay close to W4A16's (the activations' int8 rounding alone) and differ from them."""
    if kernels == "cpu" and not __import__("backend_lib.kernels.cpu", fromlist=["load"]).load():
        pytest.skip("the CPU kernels are not built here")
    ckpt = ckpts.get("tiny-w4a16", "w4a16")
    eng = make_engine(ckpt, kernels=kernels, int4_activations="int8", kv_cache_memory="4MiB", max_model_len=256)
    ref = make_engine(ckpt, kernels="reference", int4_activations="int8", kv_cache_memory="4MiB", max_model_len=256)
    w4a16 = make_engine(ckpt, kernels=kernels, kv_cache_memory="4MiB", max_model_len=256)
    lins = _linears(eng)
    assert len(lins) == 4 * len(eng.runner.model.layers)
    assert all(type(lin).__name__ == "W4A8Linear" for _, _, lin in lins)
    assert all(type(lin).__name__ == "W4A16Linear" for _, _, lin in _linears(w4a16))
    mc = ModelConfig.from_dir(ckpt)
    args = parse_quantization_config(mc.quantization_config).int4
    store, p = WeightStore(ckpt), "model.layers.1.self_attn"
    d, h, kvh = mc.head_dim, mc.num_heads, mc.num_kv_heads
    parts = [read_int4(store, f"{p}.{n}_proj", rows, mc.hidden_size, args)
             for n, rows in (("q", h * d), ("k", kvh * d), ("v", kvh * d))]
    codes, scales = ref.runner.model.layers[1].self_attn.qkv_proj.prepared   # the reference's form: as read
    assert torch.equal(codes, (torch.cat([q.codes for q in parts]).to(torch.int16) - 8).to(torch.int8))
    assert torch.equal(scales, torch.cat([q.scales for q in parts]).float())
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for (_, _, lin), (_, _, rlin), (_, _, wlin) in zip(lins, _linears(ref), _linears(w4a16)):
            x = torch.randn(5, lin.in_features, generator=gen)
            y = lin.forward(x)
            assert torch.equal(y, rlin.forward(x))
            exact = wlin.forward(x)
            err = (y - exact).norm() / exact.norm()
            assert 0 < err < 0.03


def test_int8_activations_refuse_what_they_cannot_take_naming_the_field(ckpts, bf16_ckpt, a8w8_ckpt):
    """Errors name int4_activations (and the tensor where there is one): act-order or asymmetric int4 codes, a
    checkpoint with no int4 linear (int8 or float), another kernel set (in the config and at load for
    `kernels: auto`), tensor parallel, an unknown value."""
    from backend_lib.config import EngineConfig
    from backend_lib.kernels import get_kernels
    from backend_lib.models import Qwen3ForCausalLM

    descact = ckpts.get("tiny-gptq-g32-asym-descact", "gptq", group_size=32, symmetric=False, desc_act=True)
    with pytest.raises(ValueError, match=r"int4_activations: int8 takes int4 codes in column order; "
                                         r"'model\.layers\.0\.self_attn\.q_proj' has an act-order perm"):
        make_engine(descact, kernels="reference", int4_activations="int8")
    asym = ckpts.get("tiny-ct-g64-asym", "w4a16", group_size=64, symmetric=False)
    with pytest.raises(ValueError, match=r"int4_activations: int8 takes symmetric int4 codes \(zero point 8\); "
                                         r"'model\.layers\.0\.self_attn\.q_proj' has zero points"):
        make_engine(asym, kernels="reference", int4_activations="int8")
    for ckpt, kind in ((a8w8_ckpt, "a8w8"), (bf16_ckpt, "float")):
        with pytest.raises(ValueError, match=f"int4_activations: int8 applies to int4 .* this one is {kind}"):
            make_engine(ckpt, kernels="reference", int4_activations="int8")
    ckpt = ckpts.get("tiny-w4a16", "w4a16")
    mc = ModelConfig.from_dir(ckpt)
    scheme = parse_quantization_config(mc.quantization_config)
    with pytest.raises(ValueError, match="int4_activations: int8 runs on the cpu and reference kernel sets; this "
                                         "engine runs 'triton'"):
        Qwen3ForCausalLM.from_checkpoint(WeightStore(ckpt), mc, scheme, torch.float32, torch.device("cpu"),
                                         get_kernels("cpu", "triton"), 64, int4_activations="int8")
    for kw, pattern in (({"kernels": "triton"}, "int8 runs on the cpu and reference kernel sets, not 'triton'"),
                        ({"tensor_parallel_size": 2}, "int8 is not supported with tensor_parallel_size > 1"),
                        ({"int4_activations": "int4a8"}, "'int4a8' is not one of checkpoint, int8")):
        with pytest.raises(ValueError, match=f"int4_activations: {pattern}"):
            EngineConfig(checkpoint=str(ckpt), **{"int4_activations": "int8", **kw}).validate()
    # the Triton dialect's parameters reach the same field
    cfg = EngineConfig.from_params({"checkpoint": str(ckpt), "int4_activations": "int8"})
    assert cfg.int4_activations == "int8"
