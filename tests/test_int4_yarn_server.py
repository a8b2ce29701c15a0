"""Through the real tritonserver: the three int4 weight-only formats and a YaRN config, each served by the LLM
model of the repository (the checkpoint's config.json says its format), streamed greedy tokens equal to the
offline CLI on the same checkpoint."""
from __future__ import annotations

import pytest

from helpers import GREEDY, SERVER_ENGINE, collect, offline_generate

pytestmark = [pytest.mark.slow, pytest.mark.server]

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. 敏捷的棕色狐狸跳过了懒狗。 " * 5   # past 64 positions


@pytest.fixture(scope="module")
def served(tmp_path_factory, ckpts):
    from harness.triton_server import TritonServer, make_repository

    checkpoints = {
        "qwen3_ct_w4a16": ckpts.get("tiny-ct-g64-asym", "w4a16", group_size=64, symmetric=False),
        "qwen3_gptq": ckpts.get("tiny-gptq-g64-asym-descact", "gptq", group_size=64, symmetric=False, desc_act=True),
        "qwen3_awq": ckpts.get("tiny-awq-g64", "awq", group_size=64),
        "qwen3_yarn": ckpts.get("tiny-yarn", "bf16", rope_scaling=dict(YARN), max_position_embeddings=256),
    }
    root = tmp_path_factory.mktemp("triton-int4")
    models = {name: {"_source": "qwen3_a8w8", **SERVER_ENGINE, "checkpoint": str(path)}
              for name, path in checkpoints.items()}
    models["qwen3_yarn"]["max_model_len"] = "256"
    server = TritonServer(make_repository(root / "models", models), root / "tritonserver.log").start(
        ready_models=list(models))
    yield server, checkpoints
    server.stop()


@pytest.mark.parametrize("model", ["qwen3_ct_w4a16", "qwen3_gptq", "qwen3_awq", "qwen3_yarn"])
def test_served_tokens_equal_the_offline_cli(served, model):
    server, checkpoints = served
    expected = offline_generate(checkpoints[model], LONG_PROMPT, 16)
    responses = collect(server.grpc_url, model, prompt=LONG_PROMPT, max_tokens=16, **GREEDY)
    ids = [i for _, ids, _ in responses if ids for i in ids]
    assert ids == expected["output_ids"] and len(set(ids)) > 4
    assert "".join(t for t, _, _ in responses) == expected["text"]
