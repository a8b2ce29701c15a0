"""Speculative decoding through the real tritonserver: one server with the same checkpoint as three LLM models,
`qwen3_spec` with an n-gram speculative_config, `qwen3_draft` with a draft model (the checkpoint itself) and
`qwen3_plain` without; every stream's ids are compared between them (greedy and seeded, alone and concurrent,
with a grammar, stop strings, n choices, an opted-out request), and the spec_decode counters appear on the
metrics page."""
from __future__ import annotations

import json

import pytest

from dashboard_helpers import SPEC_PREFIX, dashboard, exported_sample_names, metric_names, queries
from spec_helpers import served_both, served_ids, served_text
from helpers import SERVER_ENGINE, collect, make_peft_adapter
from harness.triton_server import TritonServer, make_repository

pytestmark = [pytest.mark.slow, pytest.mark.server]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
        "auto_disable_from_batch": None}   # gate off: drafts counted here (test_spec_gate.py)
PROMPTS = ["a b a b a b a b a b a b", "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3", "Hello, world!", "介绍一下北京故宫"]
GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 48}
SEEDED = {"temperature": 0.3, "top_k": 50, "seed": 7, "ignore_eos": True, "max_tokens": 48}


@pytest.fixture(scope="module")
def server(tmp_path_factory, a8w8_ckpt, bf16_ckpt):
    root = tmp_path_factory.mktemp("spec_triton")
    adapter = make_peft_adapter(bf16_ckpt, root / "lora_a", r=8, seed=11, std=0.15)[0]
    engine = {**SERVER_ENGINE, "_source": "qwen3_a8w8", "checkpoint": str(a8w8_ckpt)}
    lora = {"lora_modules": f"a={adapter}"}   # the draft-model and plain models serve one LoRA adapter
    repo = make_repository(root / "models", {
        "qwen3_spec": {**engine, "speculative_config": json.dumps(SPEC)},
        "qwen3_draft": {**engine, **lora, "speculative_config": json.dumps(
            {"method": "draft_model", "model": str(a8w8_ckpt), "num_speculative_tokens": 3,
             "auto_disable_from_batch": None})},
        "qwen3_plain": {**engine, **lora},
        "qwen3_tokenizer": {"checkpoint": str(a8w8_ckpt), "max_model_len": SERVER_ENGINE["max_model_len"]},
    })
    server = TritonServer(repo, root / "tritonserver.log").start()
    yield server
    server.stop()


_ids, _text = served_ids, served_text


def _both(server, jobs, spec_model="qwen3_spec"):
    return served_both(server, jobs, spec_model)


def test_served_ids_equal_speculation_off_greedy_seeded_alone_and_concurrent(server):
    before = server.metric("vllm:spec_decode_num_accepted_tokens_total", "qwen3_spec")
    for prompt in PROMPTS[:2]:   # alone
        on, off = _both(server, [(prompt, GREEDY)])
        assert _ids(on[0]) == _ids(off[0]) and len(_ids(on[0])) == 48
    jobs = [(p, GREEDY) for p in PROMPTS] + [(p, {**SEEDED, "seed": 7 + i}) for i, p in enumerate(PROMPTS)]
    jobs.append((PROMPTS[0], {**SEEDED, "speculative": "off"}))
    on, off = _both(server, jobs)
    for a, b in zip(on, off):
        assert _ids(a) == _ids(b)
        assert _text(a) == _text(b)
    assert server.wait_until(
        lambda: server.metric("vllm:spec_decode_num_accepted_tokens_total", "qwen3_spec") > before, 5)
    drafted = server.metric("vllm:spec_decode_num_draft_tokens_total", "qwen3_spec")
    accepted = server.metric("vllm:spec_decode_num_accepted_tokens_total", "qwen3_spec")
    per_pos = [server.metric("vllm:spec_decode_num_accepted_tokens_per_pos_total", "qwen3_spec", position=str(i))
               for i in range(4)]
    assert 0 < accepted <= drafted and sum(per_pos) == accepted
    with pytest.raises(KeyError):
        server.metric("vllm:spec_decode_num_drafts_total", "qwen3_plain")


def test_served_grammar_stop_strings_and_n_choices_equal_speculation_off(server):
    array = {"json": {"type": "array", "items": {"type": "integer"}}}
    (full,), _ = _both(server, [(PROMPTS[0], GREEDY)])
    text = _text(full)
    stop = text[len(text) * 3 // 4:][:3]
    jobs = [(PROMPTS[2], {"temperature": 0, "max_tokens": 48, "structured_outputs": array}),
            (PROMPTS[0], {"temperature": 0, "max_tokens": 48, "structured_outputs": {"regex": "(ab|ba|abc){3,40}"}}),
            (PROMPTS[0], {**GREEDY, "stop": [stop]}),
            (PROMPTS[1], {**SEEDED, "n": 3})]
    on, off = _both(server, jobs)
    for a, b in zip(on[:3], off[:3]):
        assert _ids(a) == _ids(b) and _text(a) == _text(b)
    assert stop not in _text(on[2])
    # n choices stream interleaved (arrival order differs between two runs): the same ids, 3 x 48 of them
    assert sorted(_ids(on[3])) == sorted(_ids(off[3])) and len(_ids(on[3])) == 3 * 48


def test_served_draft_model_ids_equal_speculation_off(server):
    """method draft_model (the checkpoint drafting for itself, k = 3): greedy and seeded, alone and concurrent,
    a grammar and a stop string; the draft's acceptance shows on the metrics page."""
    before = server.metric("vllm:spec_decode_num_accepted_tokens_total", "qwen3_draft")
    on, off = _both(server, [(PROMPTS[2], GREEDY)], "qwen3_draft")   # alone
    assert _ids(on[0]) == _ids(off[0]) and len(_ids(on[0])) == 48
    text = _text(off[0])
    stop = text[len(text) * 3 // 4:][:3]
    jobs = [(p, GREEDY) for p in PROMPTS] + [(p, {**SEEDED, "seed": 3 + i}) for i, p in enumerate(PROMPTS)]
    jobs += [(PROMPTS[3], {"temperature": 0, "max_tokens": 48,
                           "structured_outputs": {"json": {"type": "array", "items": {"type": "integer"}}}}),
             (PROMPTS[2], {**GREEDY, "stop": [stop]})]
    on, off = _both(server, jobs, "qwen3_draft")
    for a, b in zip(on, off):
        assert _ids(a) == _ids(b) and _text(a) == _text(b)
    assert stop not in _text(on[-1])
    assert server.wait_until(
        lambda: server.metric("vllm:spec_decode_num_accepted_tokens_total", "qwen3_draft") > before + 48, 5)


def test_served_lora_rows_with_a_draft_model_equal_speculation_off(server):
    """LoRA rows beside base rows on the draft-model model: the draft runs without the adapter (its drafts are the
    base model's, mostly rejected on an adapter's row), the ids stay those of the plain model with the adapter."""
    drafted = server.metric("vllm:spec_decode_num_draft_tokens_total", "qwen3_draft")
    jobs = [(PROMPTS[0], {**GREEDY, "lora_name": "a"}), (PROMPTS[2], {**SEEDED, "lora_name": "a"}),
            (PROMPTS[1], GREEDY), (PROMPTS[3], {**GREEDY, "lora_name": "a", "max_tokens": 20})]
    on, off = _both(server, jobs, "qwen3_draft")
    for a, b in zip(on, off):
        assert _ids(a) == _ids(b) and _text(a) == _text(b)
    base = _both(server, [(PROMPTS[0], GREEDY)], "qwen3_plain")[0][0]
    assert _ids(base) != _ids(on[0])    # the adapter changes the output: the rows ran with it
    assert server.wait_until(
        lambda: server.metric("vllm:spec_decode_num_draft_tokens_total", "qwen3_draft") > drafted, 5)


def test_the_dashboards_speculative_decoding_panel_names_exported_counters(server):
    """deploy/grafana's spec_decode queries select counters this server exports for the speculating model (the
    dashboard's other queries are checked by tests/test_dashboard.py against the plain server)."""
    import re

    collect(server.grpc_url, "qwen3_spec", prompt=PROMPTS[0], sampling_parameters=GREEDY)
    page = server.metrics()
    exported = exported_sample_names(page)
    names = {n for _, e in queries(dashboard()) for n in metric_names(e) if n.startswith(SPEC_PREFIX)}
    assert len(names) == 4, names
    for name in names:
        assert name in exported, name
        assert re.search(rf'^{re.escape(name)}\{{[^}}]*model="qwen3_spec"', page, re.M), name
