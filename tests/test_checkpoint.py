"""Bad checkpoints fail at load with errors that name the file, field or tensor."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend_lib.checkpoint import CheckpointError, parse_quantization_config
from helpers import make_engine


def _copy(src, tmp_path, name="ck"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder, fn):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    fn(cfg)
    path.write_text(json.dumps(cfg))


def test_a8w8_checkpoint_layout_is_compressed_tensors(a8w8_ckpt):
    cfg = json.loads((a8w8_ckpt / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "int-quantized"
    scheme = parse_quantization_config(qc)
    assert scheme.is_quantized("model.layers.0.mlp.down_proj") and not scheme.is_quantized("lm_head")
    tensors = load_file(str(a8w8_ckpt / "model.safetensors"))
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    assert tensors["model.layers.0.self_attn.q_proj.weight_scale"].shape == (128, 1)
    assert "lm_head.weight" not in tensors and cfg["tie_word_embeddings"]


def test_sharded_checkpoint_loads_the_same(bf16_ckpt, tmp_path, bf16_engine):
    dst = _copy(bf16_ckpt, tmp_path)
    tensors = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    eng = make_engine(dst)
    ids = eng.tokenizer.encode("shards")
    assert eng.score(ids) == bf16_engine.score(ids)


@pytest.mark.parametrize("mutate, message", [
    (lambda q: q.update(quant_method="bitsandbytes"), "quant_method: 'bitsandbytes'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=4), "weights.num_bits: 4"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=128),
     "weights.strategy: 'group'"),
    (lambda q: q["config_groups"]["group_0"]["input_activations"].update(dynamic=False),
     "input_activations.dynamic: False"),
    (lambda q: q["config_groups"]["group_0"]["input_activations"].update(symmetric=False),
     "input_activations.symmetric: False"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(type="float"), "weights.type: 'float'"),
    (lambda q: q.update(format="float-quantized"), "format: 'float-quantized'"),
    (lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity_config.format"),
])
def test_unsupported_quantization_is_rejected_naming_the_field(a8w8_ckpt, tmp_path, mutate, message):
    dst = _copy(a8w8_ckpt, tmp_path)
    _edit_config(dst, lambda cfg: mutate(cfg["quantization_config"]))
    with pytest.raises(CheckpointError) as err:
        make_engine(dst)
    assert message in str(err.value)


def test_missing_tensor_is_named(bf16_ckpt, tmp_path):
    dst = _copy(bf16_ckpt, tmp_path)
    tensors = load_file(str(dst / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        make_engine(dst)


def test_wrong_shape_is_named(a8w8_ckpt, tmp_path):
    dst = _copy(a8w8_ckpt, tmp_path)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"][:, :10].clone()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \[64, 10\]"):
        make_engine(dst)


def test_no_config_json(bf16_ckpt, tmp_path):
    dst = _copy(bf16_ckpt, tmp_path)
    (dst / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        make_engine(dst)


def test_not_qwen3_and_unsupported_rope_scaling(bf16_ckpt, tmp_path):
    dst = _copy(bf16_ckpt, tmp_path, "llama")
    _edit_config(dst, lambda c: c.update(model_type="llama", architectures=["LlamaForCausalLM"]))
    with pytest.raises(CheckpointError, match="model_type 'llama'"):
        make_engine(dst)
    dst = _copy(bf16_ckpt, tmp_path, "yarn")
    _edit_config(dst, lambda c: c.update(rope_scaling={"rope_type": "longrope", "factor": 4.0}))
    with pytest.raises(CheckpointError, match="rope_scaling.rope_type 'longrope' is not implemented"):
        make_engine(dst)


def test_corrupt_safetensors_and_pickle_only(bf16_ckpt, tmp_path):
    dst = _copy(bf16_ckpt, tmp_path, "corrupt")
    (dst / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        make_engine(dst)
    dst = _copy(bf16_ckpt, tmp_path, "pickle")
    (dst / "model.safetensors").rename(dst / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle checkpoints are never loaded"):
        make_engine(dst)


def test_untied_embeddings(ckpts):
    untied = ckpts.get("tiny-untied", "bf16", tie_word_embeddings=False)
    tensors = load_file(str(untied / "model.safetensors"))
    assert "lm_head.weight" in tensors
    eng = make_engine(untied)
    assert eng.runner.model.embed_tokens is not None
    ids = torch.arange(8)
    assert not torch.equal(eng.runner.model.lm_head.rows(ids), eng.runner.model.embed(ids))
    assert len(eng.generate([[1, 2, 3]], eng.make_params({"temperature": 0, "max_tokens": 4}))[0]["output_ids"]) >= 1
