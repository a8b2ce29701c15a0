"""RoPE scaling (yarn, linear) against transformers: the frequencies bit for bit, the model token for token."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from backend_lib.checkpoint import CheckpointError, ModelConfig
from backend_lib.checkpoint.rope import parse_rope
from backend_lib.kernels.reference import rotary_cos_sin
from helpers import make_engine

ORIG = 64                      # a tiny original context, so positions past it are cheap
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG}
TEXT = "The quick brown fox jumps over the lazy dog. 敏捷的棕色狐狸跳过了懒狗。 " * 7


def _hf_rope(rope_parameters, head_dim=128, max_pos=131072, **extra):
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = Qwen3Config(head_dim=head_dim, max_position_embeddings=max_pos,
                         rope_parameters={"rope_theta": 1e6, **rope_parameters}, **extra)
    if rope_parameters["rope_type"] == "default":
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        return Qwen3RotaryEmbedding.compute_default_rope_parameters(config, device="cpu")
    return ROPE_INIT_FUNCTIONS[rope_parameters["rope_type"]](config, "cpu")


@pytest.mark.parametrize("params", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},          # Qwen3's model card
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "truncate": False},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "attention_factor": 1.3},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
     "mscale_all_dim": 0.707},
    {"rope_type": "linear", "factor": 2.0},
])
def test_frequencies_and_attention_factor_equal_transformers(params):
    rope = parse_rope({"max_position_embeddings": 131072, "rope_parameters": {"rope_theta": 1e6, **params}})
    inv_freq, attention_factor = _hf_rope(params)
    assert torch.equal(rope.inv_freq(128), inv_freq)
    assert rope.attention_factor == attention_factor
    if params["rope_type"] == "yarn":
        assert rope.attention_factor != 1.0 and not torch.equal(inv_freq, _hf_rope({"rope_type": "default"})[0])


def test_default_table_is_the_kernels_table():
    default = parse_rope({"rope_theta": 1e6, "max_position_embeddings": 4096})
    assert torch.equal(default.cos_sin(32, 100), rotary_cos_sin(32, 100, 1e6))
    assert torch.equal(default.inv_freq(128), _hf_rope({"rope_type": "default"})[0])


def test_positions_follow_the_scaling():
    qwen3 = {"max_position_embeddings": 40960, "rope_theta": 1e6,
             "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    assert parse_rope(qwen3).max_positions == 131072       # Qwen3's documented 128k
    assert parse_rope({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2}}
                      ).max_positions == 8192
    assert parse_rope({"max_position_embeddings": 4096}).max_positions == 4096


@pytest.mark.parametrize("cfg, message", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type 'dynamic' is not implemented"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling.rope_type 'longrope'"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope_parameters.rope_type 'llama3'"),
    ({"rope_scaling": {**YARN, "low_freq_factor": 1.0}}, "rope_scaling.low_freq_factor is not supported"),
    ({"rope_scaling": {**YARN, "factor": -1}}, "rope_scaling.factor must be a positive number"),
    ({"rope_scaling": {**YARN, "original_max_position_embeddings": "64"}},
     "rope_scaling.original_max_position_embeddings must be a positive integer"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor is required"),
    ({"rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 64}}, "rope_scaling.factor is required"),
    ({"rope_scaling": {**YARN, "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"rope_scaling": "yarn"}, "rope_scaling must be an object"),
])
def test_unsupported_rope_is_refused_naming_the_field(cfg, message):
    with pytest.raises(CheckpointError) as err:
        parse_rope({"max_position_embeddings": 4096, "rope_theta": 1e6, **cfg})
    assert message in str(err.value)


@pytest.fixture(scope="module")
def yarn_ckpt(ckpts):
    # same seed and shapes as bf16_ckpt: the same weights, only the RoPE differs
    return ckpts.get("tiny-yarn", "bf16", rope_scaling=dict(YARN), max_position_embeddings=4 * ORIG)


def _hf_logprobs(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.mark.parametrize("kernels", ["reference", "auto"])
def test_yarn_model_equals_transformers_past_the_original_length(yarn_ckpt, bf16_engine, kernels):
    from transformers import AutoModelForCausalLM

    cfg = json.loads((yarn_ckpt / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_type"] == "yarn"
    hf = AutoModelForCausalLM.from_pretrained(str(yarn_ckpt), dtype=torch.float32).eval()
    eng = make_engine(yarn_ckpt, kernels=kernels, max_model_len=None)
    assert eng.max_model_len == 4 * ORIG
    ids = eng.tokenizer.encode(TEXT)
    assert 2 * ORIG < len(ids) < 4 * ORIG - 24
    ours = torch.tensor(eng.score(ids)[1:])
    torch.testing.assert_close(ours, _hf_logprobs(hf, ids), rtol=0, atol=1e-4)
    # the comparison can tell yarn from plain RoPE on the same weights
    plain = torch.tensor(bf16_engine.score(ids)[1:])
    assert (plain - ours)[ORIG:].abs().mean() > 100 * 1e-4

    res = eng.generate([ids], eng.make_params({"temperature": 0, "max_tokens": 24, "ignore_eos": True}))[0]
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert res["output_ids"] == out[0, len(ids):].tolist()


def test_qwen3_model_card_rope_scaling_form_loads_the_same(yarn_ckpt, tmp_path):
    """The form Qwen3's model card tells users to add (`rope_scaling` beside a top-level rope_theta)."""
    dst = tmp_path / "card"
    shutil.copytree(yarn_ckpt, dst)
    cfg = json.loads((dst / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    (dst / "config.json").write_text(json.dumps(cfg))
    assert ModelConfig.from_dir(dst).rope == ModelConfig.from_dir(yarn_ckpt).rope
    assert ModelConfig.from_dir(dst).rope.rope_type == "yarn"


def test_linear_model_equals_transformers(ckpts, bf16_engine):
    from transformers import AutoModelForCausalLM

    folder = ckpts.get("tiny-linear", "bf16", rope_scaling={"rope_type": "linear", "factor": 2.0},
                       max_position_embeddings=128)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    eng = make_engine(folder, max_model_len=None)
    assert eng.max_model_len == 256
    ids = eng.tokenizer.encode(TEXT)
    ours = torch.tensor(eng.score(ids)[1:])
    torch.testing.assert_close(ours, _hf_logprobs(hf, ids), rtol=0, atol=1e-4)
    assert (torch.tensor(bf16_engine.score(ids)[1:]) - ours).abs().mean() > 100 * 1e-4


def test_rotary_table_equals_transformers_up_to_128k_positions():
    """Qwen3's documented YaRN config (32,768 x 4): our cos / sin rows at the last positions of the 131,072 equal
    transformers' Qwen3RotaryEmbedding's (which multiplies the attention factor into cos and sin as we do)."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    cfg = {"max_position_embeddings": 40960, "rope_theta": 1e6, "head_dim": 128,
           "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    rope = parse_rope(cfg)
    assert rope.max_positions == 131072
    table = rope.cos_sin(128, rope.max_positions)
    hf = Qwen3RotaryEmbedding(Qwen3Config(**cfg))
    positions = torch.tensor([[0, 1, 32767, 32768, 100000, 131070, 131071]])
    cos, sin = hf(torch.zeros(1, positions.shape[1], 128), positions)
    torch.testing.assert_close(table[positions[0], :64], cos[0, :, :64], rtol=0, atol=0)
    torch.testing.assert_close(table[positions[0], 64:], sin[0, :, :64], rtol=0, atol=0)
