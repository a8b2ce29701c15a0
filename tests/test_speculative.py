"""Speculative decoding (backend_lib/spec): the n-gram proposer, speculative_config, and the engine's output
with speculation on compared id for id with the same engine configuration without it."""
from __future__ import annotations

import json

import pytest

from backend_lib.config import EngineConfig
from backend_lib.sampling.params import RequestError
from backend_lib.spec import parse_speculative_config, propose_ngram
from backend_lib.spec.ngram import NgramProposer
from helpers import make_engine

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
        "auto_disable_from_batch": None}   # gate off: drafts counted here (test_spec_gate.py)
# prompts whose greedy and low-temperature continuations (random demo weights) fall into loops early
PROMPTS = ["Hello, world!", "a b a b a b a b a b a b", "介绍一下北京故宫", "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3"]


# ----- the n-gram proposer ---------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_earlier_occurrence_of_the_suffix():
    toks = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3]
    # suffix [1, 2, 3]: last seen before at 5..7, followed by 5, 7, 1, 2
    assert propose_ngram(toks, 4, 2, 3) == [5, 7, 1, 2]
    assert propose_ngram(toks, 2, 2, 3) == [5, 7]


def test_ngram_prefers_the_longest_suffix_in_range():
    toks = [8, 2, 3, 6, 1, 2, 3, 4, 0, 1, 2, 3]
    assert propose_ngram(toks, 1, 3, 3) == [4]     # [1, 2, 3] -> 4
    toks2 = [1, 2, 3, 4, 7, 2, 3, 5, 1, 2, 3]
    assert propose_ngram(toks2, 1, 2, 3) == [4]    # [1, 2, 3] (seen before 4) wins over [2, 3]'s later 5
    assert propose_ngram(toks2, 1, 2, 2) == [5]    # [2, 3] alone: its latest earlier occurrence, then 5
    assert propose_ngram([5, 2, 3, 7, 9, 2, 3], 1, 2, 2) == [7]


def test_ngram_continues_a_short_loop_through_its_own_drafts():
    assert propose_ngram([4, 5, 6, 7, 7, 7], 5, 2, 4) == [7, 7, 7, 7, 7]
    assert propose_ngram([9, 1, 2, 1, 2, 1, 2], 5, 2, 4) == [1, 2, 1, 2, 1]


def test_ngram_without_a_match_or_context_proposes_nothing():
    assert propose_ngram([1, 2, 3, 4, 5], 4, 2, 4) == []
    assert propose_ngram([1, 1], 4, 2, 4) == []     # the suffix itself is the only occurrence
    assert propose_ngram([3], 4, 1, 4) == []
    assert propose_ngram([3, 3], 4, 1, 4) == [3, 3, 3, 3]   # lookup_min 1


def test_ngram_incremental_index_matches_one_shot_proposals():
    import random

    rng = random.Random(0)
    toks = [rng.randrange(6) for _ in range(300)]
    prop = NgramProposer(4, 2, 4)
    index = prop.new_index()
    for L in range(1, len(toks) + 1):
        assert prop.propose(toks[:L], index) == propose_ngram(toks[:L], 4, 2, 4), L


# ----- speculative_config -------------------------------------------------------------------------------
def test_speculative_config_takes_vllms_keys():
    cfg = parse_speculative_config(json.dumps(SPEC))
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 4, 2, 4)
    assert parse_speculative_config(None) is None and parse_speculative_config("") is None
    only_max = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (5, 5)   # vLLM: one sets the other


@pytest.mark.parametrize("value, key", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "speculative_config.method"),
    ({"method": "eagle3", "num_speculative_tokens": 3}, "speculative_config.model"),   # eagle3 needs its head
    ({"method": "medusa2", "num_speculative_tokens": 3}, "speculative_config.method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "speculative_config.prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 0}, "speculative_config.prompt_lookup_max"),
    ({"model": "Qwen/Qwen3-0.6B", "num_speculative_tokens": 4}, "speculative_config.model"),
    ({"method": "ngram", "num_speculative_tokens": 4, "lookahead": 2}, "speculative_config.lookahead"),
    ({"method": "ngram", "num_speculative_tokens": 4, "min_acceptance": 2}, "speculative_config.min_acceptance"),
    ("{not json", "speculative_config"),
    ("[1, 2]", "speculative_config"),
])
def test_speculative_config_errors_name_the_key(value, key, bf16_ckpt):
    with pytest.raises(ValueError) as e:
        parse_speculative_config(value)
    assert key in str(e.value)
    text = value if isinstance(value, str) else json.dumps(value)
    with pytest.raises(ValueError) as e:   # the model parameter, validated at load
        EngineConfig.from_params({"checkpoint": str(bf16_ckpt), "speculative_config": text})
    assert key in str(e.value)


def test_speculative_config_is_a_model_parameter(bf16_ckpt):
    cfg = EngineConfig.from_params({"checkpoint": str(bf16_ckpt), "speculative_config": json.dumps(SPEC)})
    assert cfg.speculative.num_speculative_tokens == 4
    assert EngineConfig.from_params({"checkpoint": str(bf16_ckpt), "speculative_config": ""}).speculative is None


def test_per_request_opt_out_and_unknown_values_name_the_field(bf16_engine):
    assert bf16_engine.make_params({"speculative": "off"}).speculative == "off"
    assert bf16_engine.make_params({}).speculative == "auto"
    for bad in ("no", True, 0):
        with pytest.raises(RequestError, match="speculative"):
            bf16_engine.make_params({"speculative": bad})


# ----- the engine: ids with speculation on equal ids without it ---------------------------------------------
@pytest.fixture(scope="module")
def spec_engine(bf16_ckpt):
    return make_engine(bf16_ckpt, speculative_config=json.dumps(SPEC))


def _ids(engine, prompts, datas):
    datas = datas if isinstance(datas, list) else [datas] * len(prompts)
    res = engine.generate(prompts, [engine.make_params(d) for d in datas])
    return [(r["output_ids"], r["finish_reason"], r["text"]) for r in res]


def _accepted(engine):
    return engine.stats.spec_num_accepted_tokens


def _compare(off, on, prompts, datas, min_accepted=1):
    before = _accepted(on)
    expected = _ids(off, prompts, datas)
    got = _ids(on, prompts, datas)
    assert got == expected
    assert _accepted(on) - before >= min_accepted, "no draft was accepted: the test exercised no verification"
    return got


def _prompts(engine):
    return [engine.tokenizer.encode(p) for p in PROMPTS]


GREEDY = {"temperature": 0, "max_tokens": 48, "ignore_eos": True}
# a low temperature: the random demo weights then fall into loops often enough for drafts to be accepted
SEEDED = {"temperature": 0.3, "top_p": 0.95, "top_k": 50, "seed": 11, "max_tokens": 48, "ignore_eos": True}


def test_greedy_and_seeded_alone_and_batched_equal_plain_decoding(bf16_engine, spec_engine):
    prompts = _prompts(bf16_engine)
    _compare(bf16_engine, spec_engine, prompts[1:2], GREEDY)        # alone
    _compare(bf16_engine, spec_engine, prompts, GREEDY)             # batched
    seeded = [{**SEEDED, "seed": 11 + i} for i in range(len(prompts))]
    _compare(bf16_engine, spec_engine, prompts, seeded)
    _compare(bf16_engine, spec_engine, prompts[1:2], seeded[1], min_accepted=0)   # a seeded request alone
    s = spec_engine.stats
    assert s.spec_num_drafts > 0 and s.spec_num_accepted_tokens <= s.spec_num_draft_tokens
    assert sum(s.spec_accepted_per_pos) == s.spec_num_accepted_tokens
    assert list(s.spec_accepted_per_pos) == sorted(s.spec_accepted_per_pos, reverse=True)


def test_mixed_batch_of_verifications_decodes_prefills_and_opt_outs(bf16_engine, spec_engine):
    """Long prompts joining while others verify (the chunk budget is 64 tokens: prefill chunks share steps
    with verification rows), greedy and seeded, one request opted out."""
    prompts = _prompts(bf16_engine)
    long_prompt = bf16_engine.tokenizer.encode("Speculative decoding keeps the output. " * 12)
    prompts = [prompts[0], prompts[1], long_prompt, prompts[3], prompts[1]]
    datas = [GREEDY, SEEDED, {**GREEDY, "max_tokens": 30}, {**SEEDED, "seed": 5, "speculative": "off"},
             {**GREEDY, "max_tokens": 40}]
    _compare(bf16_engine, spec_engine, prompts, datas)


def test_streamed_outputs_logprobs_penalties_and_min_tokens_equal_plain_decodings(bf16_engine, spec_engine):
    """Step by step: the same deltas (one per token, in order) with the same logprobs, whatever the drafts;
    penalties, bad words and min_tokens see the tokens accepted before each position."""
    prompts = _prompts(bf16_engine)[1:4:2]
    datas = [{**GREEDY, "logprobs": 3, "repetition_penalty": 1.05, "frequency_penalty": 0.1},
             {**SEEDED, "logprobs": 0, "presence_penalty": 0.2, "min_tokens": 20, "ignore_eos": False,
              "bad_words": ["b a b"]}]

    def run(engine):
        for i, (p, d) in enumerate(zip(prompts, datas)):
            engine.add_request(f"lp{i}", p, engine.make_params(d))
        outs = []
        while engine.has_unfinished():
            outs += [(o.request_id, o.new_token_ids, o.new_text, o.new_logprobs, o.cumulative_logprob, o.finished)
                     for o in engine.step()]
        return sorted(outs, key=lambda o: o[0])   # each request's deltas in order

    before = _accepted(spec_engine)
    assert run(spec_engine) == run(bf16_engine)
    assert _accepted(spec_engine) > before


def test_max_tokens_and_stop_inside_an_accepted_run_end_exactly(bf16_engine, spec_engine):
    p = _prompts(bf16_engine)[1]
    (ids, _, text), = _ids(bf16_engine, [p], GREEDY)
    for cut in (21, 22, 23):   # wherever a run of accepted drafts ends
        got = _ids(spec_engine, [p], {**GREEDY, "max_tokens": cut})
        assert got[0][0] == ids[:cut] and got[0][1] == "length"
    # a stop id and a stop string taken from late in the output
    stop_id = ids[40]
    got = _compare(bf16_engine, spec_engine, [p], {**GREEDY, "stop_token_ids": [stop_id]}, min_accepted=0)
    assert got[0][0] == ids[:ids.index(stop_id) + 1] and got[0][1] == "stop"
    stop = text[len(text) * 3 // 4:][:3]
    assert stop.strip()
    got = _compare(bf16_engine, spec_engine, [p], {**GREEDY, "stop": [stop]}, min_accepted=0)
    assert stop not in got[0][2] and got[0][1] == "stop"


def test_structured_output_equals_plain_decoding(bf16_engine, spec_engine):
    """The grammar advances per accepted token (the output processor's accept), masks each verified row at
    that point of the grammar, and ends the request where plain decoding ends it."""
    prompts = _prompts(bf16_engine)[:3]
    array = {"json": {"type": "array", "items": {"type": "integer"}}}
    datas = [{"temperature": 0, "max_tokens": 48, "structured_outputs": array},
             {"temperature": 0, "max_tokens": 48, "structured_outputs": {"regex": r"(ab|ba|abc){3,40}"}},
             {**SEEDED, "ignore_eos": False, "structured_outputs": array}]
    _compare(bf16_engine, spec_engine, prompts, datas)


def test_choices_of_one_prompt_share_its_prefill_and_equal_plain_decoding(bf16_engine, spec_engine):
    """n > 1 as the Triton model sends it: n requests of one prompt, choice j seeded seed + j (prefix cache
    and the partial last page taken by copy)."""
    prompt = _prompts(bf16_engine)[3]
    datas = [{**SEEDED, "seed": 40 + j} for j in range(4)] + [GREEDY, GREEDY]
    _compare(bf16_engine, spec_engine, [prompt] * len(datas), datas)


def test_rejected_tokens_never_reach_the_prefix_cache(bf16_engine, spec_engine):
    """After speculative runs, a later request whose prompt is a sequence's own output (prompt + generated)
    reuses the cached pages, and gets the ids of plain decoding: the cached pages hold committed tokens only."""
    p = _prompts(bf16_engine)[1]
    first = _ids(spec_engine, [p], GREEDY)[0][0]
    again = p + first[:40]
    hits = spec_engine.stats.prefix_cache_hits
    assert _ids(spec_engine, [again], {**GREEDY, "max_tokens": 40}) == _ids(bf16_engine, [again],
                                                                             {**GREEDY, "max_tokens": 40})
    assert spec_engine.stats.prefix_cache_hits - hits >= 16 * 2
    assert spec_engine.block_manager.num_used == 0   # every page back (rejected ones included)


def test_turboquant_cache_and_the_layer_loop_equal_plain_decoding(bf16_ckpt, a8w8_ckpt):
    prompts = None
    for ckpt, kw in ((bf16_ckpt, {"kv_cache": "tq"}), (a8w8_ckpt, {"dtype": "bfloat16"})):
        off = make_engine(ckpt, **kw)
        on = make_engine(ckpt, speculative_config=json.dumps(SPEC), **kw)
        prompts = prompts or _prompts(off)
        _compare(off, on, prompts, [GREEDY, SEEDED, GREEDY, GREEDY])


def test_preemption_with_speculation_recomputes_identically(bf16_ckpt, bf16_engine):
    """A pool of 12 pages of 16 tokens for 4 requests of ~70 tokens: preemptions mid-speculation."""
    on = make_engine(bf16_ckpt, kv_cache_memory=12 * 16 * 1024, max_model_len=192, max_num_seqs=4,
                     speculative_config=json.dumps(SPEC))
    assert on.runner.kv_cache.num_pages == 12
    prompts = _prompts(bf16_engine)
    datas = [{**GREEDY, "max_tokens": 60}, {**SEEDED, "max_tokens": 60}, {**GREEDY, "max_tokens": 64},
             {**SEEDED, "seed": 8, "max_tokens": 60}]
    _compare(bf16_engine, on, prompts, datas)
    assert on.stats.num_preemptions > 0
    assert on.block_manager.num_used == 0


def test_auto_disable_pauses_a_request_whose_drafts_fail(bf16_ckpt):
    """min_acceptance 1.0 with a window of 4: every window with a rejection pauses the request's drafts, so it
    drafts far less than with the pause off, and the ids stay plain decoding's."""
    strict = make_engine(bf16_ckpt, speculative_config=json.dumps({**SPEC, "min_acceptance": 1.0,
                                                                   "acceptance_window": 4}))
    lax = make_engine(bf16_ckpt, speculative_config=json.dumps({**SPEC, "min_acceptance": 0.0}))
    prompts = _prompts(strict)[1::2]
    data = {**GREEDY, "max_tokens": 64}
    assert _ids(strict, prompts, data) == _ids(lax, prompts, data)
    assert 0 < strict.stats.spec_num_drafts < lax.stats.spec_num_drafts


def test_disable_by_batch_size_drafts_only_below_it(bf16_ckpt, bf16_engine):
    on = make_engine(bf16_ckpt, speculative_config=json.dumps({**SPEC, "disable_by_batch_size": 2}))
    prompts = _prompts(bf16_engine)[1::2]
    assert _ids(on, prompts, GREEDY) == _ids(bf16_engine, prompts, GREEDY)
    batched = on.stats.spec_num_drafts
    assert batched == 0    # two requests running together all along
    _compare(bf16_engine, on, prompts[1:2], GREEDY)
    assert on.stats.spec_num_drafts > batched


# ----- metrics --------------------------------------------------------------------------------------
class _Metric:
    def __init__(self, labels):
        self.labels, self.value = labels, 0

    def increment(self, v):
        self.value += v

    def set(self, v):
        self.value = v

    def observe(self, v):
        pass


class _Family:
    GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"
    made: dict = {}

    def __init__(self, name, description, kind):
        self.name, self.kind, self.metrics = name, kind, []
        _Family.made[name] = self

    def Metric(self, labels, buckets=None):  # noqa: N802 (pb_utils' name)
        m = _Metric(labels)
        self.metrics.append(m)
        return m


def test_metrics_publish_vllms_spec_decode_counters(spec_engine, bf16_engine):
    import types

    from backend_lib.serving.metrics import EngineMetrics, MetricsBuffer

    _Family.made = {}
    metrics = EngineMetrics(types.SimpleNamespace(MetricFamily=_Family), {"model": "m", "version": "1"}, 1024,
                            spec_positions=4)
    _compare(bf16_engine, spec_engine, _prompts(bf16_engine)[1:2], GREEDY)
    s = spec_engine.stats
    for _ in range(2):   # twice: counters take increments, never the totals again
        metrics.flush(MetricsBuffer(), s)
    value = lambda name: _Family.made[name].metrics[0].value  # noqa: E731
    assert value("vllm:spec_decode_num_drafts_total") == s.spec_num_drafts > 0
    assert value("vllm:spec_decode_num_draft_tokens_total") == s.spec_num_draft_tokens
    assert value("vllm:spec_decode_num_accepted_tokens_total") == s.spec_num_accepted_tokens > 0
    per_pos = _Family.made["vllm:spec_decode_num_accepted_tokens_per_pos_total"].metrics
    assert [m.labels["position"] for m in per_pos] == ["0", "1", "2", "3"]
    assert [m.value for m in per_pos] == list(s.spec_accepted_per_pos)
    # without speculative decoding the family is not published at all
    _Family.made = {}
    EngineMetrics(types.SimpleNamespace(MetricFamily=_Family), {"model": "m", "version": "1"}, 1024)
    assert not any(name.startswith("vllm:spec_decode") for name in _Family.made)
