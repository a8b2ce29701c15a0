"""Speculative decoding with a draft model (speculative_config method draft_model, backend_lib/spec/draft_model.py):
the configuration's errors, and the engine's output with a draft compared id for id with the same engine
configuration without speculation. Drafts: the target checkpoint itself (every greedy draft is the target's
token, so most are accepted) and a 1-layer checkpoint of the same vocabulary (drafts mostly rejected)."""
from __future__ import annotations

import json
import shutil

import pytest

from backend_lib.config import EngineConfig
from backend_lib.spec import parse_speculative_config
from helpers import make_engine
from spec_helpers import GREEDY, PROMPTS, SEEDED, compare_spec, spec_ids


def _draft(model, k=4, **kw):
    return json.dumps({"method": "draft_model", "model": str(model), "num_speculative_tokens": k,
                       "auto_disable_from_batch": None, **kw})   # gate off: drafts counted here (test_spec_gate.py)


@pytest.fixture(scope="module")
def one_layer_ckpt(ckpts):
    return ckpts.get("tiny-bf16-1layer", "bf16", num_hidden_layers=1, seed=3)


@pytest.fixture(scope="module")
def self_draft(bf16_ckpt):
    """The target as its own draft."""
    return make_engine(bf16_ckpt, speculative_config=_draft(bf16_ckpt))


@pytest.fixture(scope="module")
def small_draft(bf16_ckpt, one_layer_ckpt):
    return make_engine(bf16_ckpt, speculative_config=_draft(one_layer_ckpt, k=3))


def _prompts(engine):
    return [engine.tokenizer.encode(p) for p in PROMPTS]


def _pages_back(engine):
    assert engine.block_manager.num_used == 0
    assert engine.spec.proposer.block_manager.num_used == 0   # the draft's own pool too


# ----- speculative_config ---------------------------------------------------------------------------
def test_draft_model_config_takes_vllms_keys(bf16_ckpt):
    cfg = parse_speculative_config(_draft(bf16_ckpt, k=5))
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("draft_model", str(bf16_ckpt), 5)
    # vLLM: a model without a method is a draft model
    alone = parse_speculative_config({"model": str(bf16_ckpt), "num_speculative_tokens": 2})
    assert alone.method == "draft_model"


def test_draft_model_path_relative_to_the_model_folder(bf16_ckpt, tmp_path):
    link = tmp_path / "draft"
    link.symlink_to(bf16_ckpt, target_is_directory=True)
    params = {"checkpoint": str(bf16_ckpt), "speculative_config": json.dumps(
        {"method": "draft_model", "model": "draft", "num_speculative_tokens": 3})}
    cfg = EngineConfig.from_params(params, base_dir=str(tmp_path))
    assert cfg.speculative.model == str(link)
    with pytest.raises(ValueError, match="speculative_config.model"):
        EngineConfig.from_params(params)    # relative to the working directory: no such folder


@pytest.mark.parametrize("value, key", [
    ({"method": "draft_model", "num_speculative_tokens": 3}, "speculative_config.model"),
    ({"method": "draft_model", "model": "", "num_speculative_tokens": 3}, "speculative_config.model"),
    ({"method": "draft_model", "model": "/nonexistent/draft", "num_speculative_tokens": 3},
     "speculative_config.model"),
    ({"method": "draft_model", "model": 7, "num_speculative_tokens": 3}, "speculative_config.model"),
    ({"method": "ngram", "model": "CKPT", "num_speculative_tokens": 3}, "speculative_config.model"),
    ({"method": "draft_model", "model": "CKPT", "num_speculative_tokens": 0},
     "speculative_config.num_speculative_tokens"),
    ({"method": "draft_model", "model": "CKPT", "num_speculative_tokens": 17},
     "speculative_config.num_speculative_tokens"),
    ({"method": "draft_model", "model": "CKPT"}, "speculative_config.num_speculative_tokens"),
    ({"method": "draft_model", "model": "CKPT", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
     "speculative_config.prompt_lookup_max"),
])
def test_draft_model_config_errors_name_the_key(value, key, bf16_ckpt):
    value = {k: (str(bf16_ckpt) if v == "CKPT" else v) for k, v in value.items()}
    with pytest.raises(ValueError) as e:
        EngineConfig.from_params({"checkpoint": str(bf16_ckpt), "speculative_config": json.dumps(value)})
    assert key in str(e.value)


def _copy_with(ckpt, dest, **config):
    shutil.copytree(ckpt, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg.update(config)
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def test_a_draft_with_another_vocabulary_or_fewer_positions_is_refused_at_load(bf16_ckpt, tmp_path):
    other = _copy_with(bf16_ckpt, tmp_path / "other_vocab", vocab_size=32000)
    with pytest.raises(ValueError, match="speculative_config.model: the draft's vocabulary has 32000 ids"):
        make_engine(bf16_ckpt, speculative_config=_draft(other))
    short = _copy_with(bf16_ckpt, tmp_path / "short", max_position_embeddings=512)
    with pytest.raises(ValueError, match="speculative_config.model: the draft serves 512 positions"):
        make_engine(bf16_ckpt, speculative_config=_draft(short))    # max_model_len 1024


# ----- the engine: ids with a draft model equal ids without speculation -----------------------------------
def test_self_draft_greedy_and_seeded_alone_and_batched_equal_plain_decoding(bf16_engine, self_draft):
    prompts = _prompts(bf16_engine)
    compare_spec(bf16_engine, self_draft, prompts[:1], GREEDY, min_accepted=20)    # alone: nearly all accepted
    compare_spec(bf16_engine, self_draft, prompts, GREEDY, min_accepted=4 * 20)    # batched
    seeded = [{**SEEDED, "seed": 11 + i} for i in range(len(prompts))]
    compare_spec(bf16_engine, self_draft, prompts, seeded)
    compare_spec(bf16_engine, self_draft, prompts[2:3], {**SEEDED, "temperature": 0.9}, min_accepted=0)
    s = self_draft.stats
    assert sum(s.spec_accepted_per_pos) == s.spec_num_accepted_tokens <= s.spec_num_draft_tokens
    _pages_back(self_draft)


def test_one_layer_draft_mixed_batch_grammar_and_stops_equal_plain_decoding(bf16_engine, small_draft):
    """A draft that is mostly wrong (every rejection rolls the draft KV back), prefill chunks sharing steps with
    verification rows, an opted-out request, a JSON schema and a regex grammar, a stop string."""
    prompts = _prompts(bf16_engine)
    long_prompt = bf16_engine.tokenizer.encode("Speculative decoding keeps the output. " * 12)
    array = {"json": {"type": "array", "items": {"type": "integer"}}}
    (ids, _, text), = spec_ids(bf16_engine, prompts[1:2], GREEDY)
    stop = text[len(text) * 3 // 4:][:3]
    assert stop.strip()
    jobs = [(prompts[0], GREEDY), (long_prompt, {**SEEDED, "max_tokens": 30}),
            (prompts[3], {**SEEDED, "seed": 5, "speculative": "off"}),
            (prompts[2], {"temperature": 0, "max_tokens": 48, "structured_outputs": array}),
            (prompts[1], {"temperature": 0, "max_tokens": 48, "structured_outputs": {"regex": r"(ab|ba|abc){3,40}"}}),
            (prompts[1], {**GREEDY, "stop": [stop]})]
    got = compare_spec(bf16_engine, small_draft, [p for p, _ in jobs], [d for _, d in jobs], min_accepted=0,
                       min_drafts=40)
    assert got[5][1] == "stop" and stop not in got[5][2]
    _pages_back(small_draft)


def test_max_tokens_and_stop_ids_inside_an_accepted_run_end_exactly(bf16_engine, self_draft):
    p = _prompts(bf16_engine)[1]
    (ids, _, _), = spec_ids(bf16_engine, [p], GREEDY)
    for cut in (9, 10, 11, 12):     # k = 4: wherever in a run of 5 the limit falls
        got = compare_spec(bf16_engine, self_draft, [p], {**GREEDY, "max_tokens": cut}, min_accepted=cut // 2)
        assert got[0][0] == ids[:cut] and got[0][1] == "length"
    stop_id = ids[30]
    got = compare_spec(bf16_engine, self_draft, [p], {**GREEDY, "stop_token_ids": [stop_id]})
    assert got[0][0] == ids[:ids.index(stop_id) + 1] and got[0][1] == "stop"
    _pages_back(self_draft)


def test_preemption_with_a_draft_model_recomputes_identically(bf16_ckpt, bf16_engine):
    """A pool of 12 pages of 16 tokens for 4 requests of ~70 tokens: preemptions mid-speculation free the draft
    pages too; the preempted requests catch their draft KV up again."""
    on = make_engine(bf16_ckpt, kv_cache_memory=12 * 16 * 1024, max_model_len=192, max_num_seqs=4,
                     speculative_config=_draft(bf16_ckpt))
    assert on.runner.kv_cache.num_pages == 12 and on.spec.proposer.block_manager.num_pages == 12
    prompts = _prompts(bf16_engine)
    datas = [{**GREEDY, "max_tokens": 60}, {**SEEDED, "max_tokens": 60}, {**GREEDY, "max_tokens": 64},
             {**SEEDED, "seed": 8, "max_tokens": 60}]
    compare_spec(bf16_engine, on, prompts, datas, min_accepted=40)
    assert on.stats.num_preemptions > 0
    _pages_back(on)


def test_abort_mid_speculation_gives_every_draft_page_back(bf16_engine, self_draft):
    prompts = _prompts(bf16_engine)
    for i, p in enumerate(prompts):
        self_draft.add_request(f"ab{i}", p, self_draft.make_params(GREEDY))
    for _ in range(4):
        self_draft.step()
    assert self_draft.spec.proposer.block_manager.num_used > 0
    self_draft.abort("ab1")
    self_draft.abort_all()
    _pages_back(self_draft)


def test_draft_prefix_cache_serves_a_repeated_prompt(bf16_engine, self_draft):
    """The second request of a prompt takes the draft pages of its full pages from the draft pool's prefix cache
    (committed tokens only: the ids stay plain decoding's)."""
    p = bf16_engine.tokenizer.encode("Draft pages are cached by content. " * 6)
    assert len(p) > 40
    prop = self_draft.spec.proposer
    compare_spec(bf16_engine, self_draft, [p], GREEDY)
    hits = prop.prefix_hits
    compare_spec(bf16_engine, self_draft, [p], {**GREEDY, "max_tokens": 20})
    assert prop.prefix_hits - hits >= 16 * ((len(p) - 1) // 16)
    _pages_back(self_draft)


def test_a_failing_draft_fails_no_request(bf16_engine, self_draft, monkeypatch):
    """A fault in a draft forward: that step's rows decode without drafts, every request still gets plain
    decoding's ids, and later steps draft again."""
    on = self_draft
    prop = on.spec.proposer
    faults = prop.num_faults
    real, calls = prop._forward, []

    def flaky(batch):
        calls.append(1)
        if len(calls) in (3, 4, 9):
            raise RuntimeError("injected draft fault")
        return real(batch)

    monkeypatch.setattr(prop, "_forward", flaky)
    prompts = _prompts(bf16_engine)
    got = compare_spec(bf16_engine, on, prompts, GREEDY, min_accepted=20)
    assert all(r[1] == "length" for r in got)
    assert prop.num_faults - faults == 3
    _pages_back(on)
