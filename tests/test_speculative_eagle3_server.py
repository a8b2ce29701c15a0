"""EAGLE-3 through the real tritonserver: one server, the same A8W8 checkpoint as two LLM models, `qwen3_eagle`
with an EAGLE-3 head (tools/make_eagle3_head.py --copy: the hand-built induction head in the published layout,
whose drafts are accepted where the demo's random weights loop) and `qwen3_plain` without; every stream's ids
and text are compared between them (greedy and seeded, alone and concurrent, a stop string, an opted-out
request) and the spec_decode counters show accepted drafts."""
from __future__ import annotations

import json

import pytest

from backend_lib.tools.make_eagle3_head import build as build_head
from spec_helpers import served_both, served_ids, served_text
from helpers import SERVER_ENGINE, make_peft_adapter
from harness.triton_server import TritonServer, make_repository

pytestmark = [pytest.mark.slow, pytest.mark.server]
PROMPTS = ["a b a b a b a b a b a b", "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3", "Hello, world!", "介绍一下北京故宫"]
GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 40}
SEEDED = {"temperature": 0.3, "top_k": 50, "seed": 7, "ignore_eos": True, "max_tokens": 40}


@pytest.fixture(scope="module")
def server(tmp_path_factory, a8w8_ckpt, bf16_ckpt):
    root = tmp_path_factory.mktemp("eagle3_triton")
    head = build_head(a8w8_ckpt, root / "head", copy=True)
    adapter = make_peft_adapter(bf16_ckpt, root / "lora_a", r=8, seed=11, std=0.15)[0]
    lora = {"lora_modules": f"a={adapter}"}   # both models serve one LoRA adapter
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "min_acceptance": 0.0,
            "auto_disable_from_batch": None}   # gate off: drafts counted here (test_spec_gate.py)
    engine = {**SERVER_ENGINE, "_source": "qwen3_a8w8", "checkpoint": str(a8w8_ckpt)}
    repo = make_repository(root / "models", {
        "qwen3_eagle": {**engine, **lora, "speculative_config": json.dumps(spec)},
        "qwen3_plain": {**engine, **lora},
        "qwen3_tokenizer": {"checkpoint": str(a8w8_ckpt), "max_model_len": SERVER_ENGINE["max_model_len"]},
    })
    server = TritonServer(repo, root / "tritonserver.log").start()
    yield server
    server.stop()


_ids, _text = served_ids, served_text


def _both(server, jobs, spec_model="qwen3_eagle"):
    return served_both(server, jobs, spec_model)


def test_served_ids_with_an_eagle3_head_equal_speculation_off(server):
    before = server.metric("vllm:spec_decode_num_accepted_tokens_total", "qwen3_eagle")
    (alone,), (plain,) = _both(server, [(PROMPTS[0], GREEDY)])
    assert _ids(alone) == _ids(plain) and len(_ids(alone)) == 40
    text = _text(plain)
    stop = text[len(text) * 3 // 4:][:3]
    jobs = [(p, GREEDY) for p in PROMPTS] + [(p, {**SEEDED, "seed": 7 + i}) for i, p in enumerate(PROMPTS)]
    jobs += [(PROMPTS[0], {**SEEDED, "speculative": "off"}), (PROMPTS[0], {**GREEDY, "stop": [stop]})]
    on, off = _both(server, jobs)
    for a, b in zip(on, off):
        assert _ids(a) == _ids(b)
        assert _text(a) == _text(b)
    assert stop not in _text(on[-1])
    assert server.wait_until(
        lambda: server.metric("vllm:spec_decode_num_accepted_tokens_total", "qwen3_eagle") > before, 5)
    drafted = server.metric("vllm:spec_decode_num_draft_tokens_total", "qwen3_eagle")
    accepted = server.metric("vllm:spec_decode_num_accepted_tokens_total", "qwen3_eagle")
    assert 0 < accepted <= drafted


def test_served_grammar_and_lora_rows_with_an_eagle3_head_equal_speculation_off(server):
    """A JSON schema and a regex grammar (the grammar advances per accepted draft and rolls back with the rest) and
    LoRA rows beside base rows (the head drafts from the adapted target's hidden states without an adapter of its
    own): ids and text equal the plain model's."""
    schema = {"type": "array", "items": {"type": "integer"}}
    jobs = [(PROMPTS[0], {"temperature": 0, "max_tokens": 40, "structured_outputs": {"json": schema}}),
            (PROMPTS[1], {"temperature": 0, "max_tokens": 24, "structured_outputs": {"regex": "(a b ){2,8}"}}),
            (PROMPTS[0], {**GREEDY, "lora_name": "a"}), (PROMPTS[2], {**SEEDED, "lora_name": "a"}),
            (PROMPTS[1], GREEDY)]
    on, off = _both(server, jobs)
    for a, b in zip(on, off):
        assert _ids(a) == _ids(b) and _text(a) == _text(b)
    assert _text(on[0]).lstrip().startswith("[")   # the schema's array (cut by max_tokens: random weights)
    base = _both(server, [(PROMPTS[0], GREEDY)])[1][0]
    assert _ids(base) != _ids(on[2])    # the adapter changes the output: the rows ran with it
