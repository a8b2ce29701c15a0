"""One request never hurts another, in the engine: extreme parameters, a failing sampler row or text
state fail (or serve) that request alone, and every other request of the step keeps its exact tokens.
Fuzzed with hypothesis (a bounded profile here; QWEN3_FUZZ_EXAMPLES raises it on demand)."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend_lib.contract.errors import RequestError
from backend_lib.contract.fields import SamplingLimits
from backend_lib.sampling import SampleError, Sampler, SamplingParams
from backend_lib.serving.triton_tokenizer import tokenize_request
from helpers import CONVERSATIONS, EXTREMES

FUZZ = settings(max_examples=int(os.environ.get("QWEN3_FUZZ_EXAMPLES", "25")), deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
REF_PROMPTS = [[9707, 11, 1879, 0], [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]]
FIELDS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "logprobs")


def _greedy(eng, n=12):
    return eng.make_params({"temperature": 0, "max_tokens": n, "ignore_eos": True})


@pytest.fixture(scope="module")
def references(bf16_engine):
    return [bf16_engine.generate([p], _greedy(bf16_engine))[0]["output_ids"] for p in REF_PROMPTS]


def _run_beside_references(eng, odd_prompt, odd_params, references):
    """The odd request in one batch with the greedy references; returns the odd result."""
    results = eng.generate(REF_PROMPTS + [odd_prompt], [_greedy(eng)] * len(REF_PROMPTS) + [odd_params])
    assert [r["output_ids"] for r in results[:-1]] == references, "a well-behaved request changed its tokens"
    assert eng.block_manager.num_used == 0 and not eng.has_unfinished()
    return results[-1]


@pytest.mark.parametrize("fields", EXTREMES, ids=[json.dumps(e) for e in EXTREMES])
def test_numerically_extreme_parameters_serve_that_request_and_no_other_is_touched(bf16_engine, references, fields):
    eng = bf16_engine
    params = eng.make_params({"max_tokens": 6, "seed": 1, **fields})
    res = _run_beside_references(eng, REF_PROMPTS[0], params, references)
    assert res["error"] is None and res["finish_reason"] in ("stop", "length") and res["output_ids"]


def test_tiny_temperature_is_greedy(bf16_engine, references):
    eng = bf16_engine
    res = eng.generate([REF_PROMPTS[0]], eng.make_params({"temperature": 1e-7, "max_tokens": 12, "ignore_eos": True,
                                                           "seed": 3}))[0]
    assert res["output_ids"] == references[0]


def test_a_failing_text_state_fails_its_request_alone(bf16_engine, references, monkeypatch):
    eng = bf16_engine
    real_add = eng.output.add

    def add(seq):
        real_add(seq)
        if seq.params.seed == 4242:   # this request's detokenizer breaks on its first token
            def boom(token_id):
                raise UnicodeError("broken detokenizer")
            eng.output._text[seq.request_id].detokenizer.add = boom

    monkeypatch.setattr(eng.output, "add", add)
    params = eng.make_params({"temperature": 0.5, "seed": 4242, "max_tokens": 6})
    res = _run_beside_references(eng, REF_PROMPTS[1], params, references)
    assert res["finish_reason"] == "error" and "broken detokenizer" in res["error"]


def test_sampler_isolates_rows():
    class Seq:
        def __init__(self, params):
            self.params, self.prompt_ids, self.output_ids = params, [1], []
            self.min_tokens_blocked_ids = [0]
            self.generator = torch.Generator().manual_seed(0)
            self.grammar = None

    def p(**kw):
        return SamplingParams(**kw).validate(SamplingLimits(), 8)

    logits = torch.tensor([[0.0, 5.0, 1.0, 0.0, 0, 0, 0, 0]] * 3)
    logits[1, 3] = float("nan")
    out = Sampler()(logits, [Seq(p(temperature=0)), Seq(p(temperature=0)), Seq(p(temperature=0.5, top_p=0.5))])
    assert out[0].token_id == 1 and out[2].token_id == 1
    assert isinstance(out[1], SampleError) and "non-finite" in out[1].message


# ----- fuzzing -----------------------------------------------------------------------------------
def _any_value():
    return st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                     st.floats(min_value=-1e-300, max_value=1e-300), st.text(max_size=4),
                     st.lists(st.integers(-5, 200000), max_size=3))


@FUZZ
@given(fields=st.dictionaries(st.sampled_from(FIELDS + ("stop", "stop_token_ids", "ignore_eos")), _any_value(),
                              max_size=5),
       stop=st.lists(st.text(max_size=3), max_size=3))
def test_fuzzed_sampling_parameters_get_a_normal_answer_or_an_error_naming_a_field(bf16_engine, references, fields,
                                                                                   stop):
    eng = bf16_engine
    data = {**fields, "stop": stop} if stop else dict(fields)
    data.setdefault("max_tokens", 4)
    try:
        params = eng.make_params(data)
        eng.make_request("probe", REF_PROMPTS[0], params)
    except RequestError as exc:
        assert any(name in str(exc) for name in data), f"error names no field: {exc}"
        return
    if params.max_tokens is None or params.max_tokens > 6:   # keep the example cheap
        params.max_tokens = 6
        params.min_tokens = min(params.min_tokens, 6)
    res = _run_beside_references(eng, REF_PROMPTS[0], params, references)
    assert res["error"] is None and res["finish_reason"] in ("stop", "length")


_scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=5))
_message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), _scalar)},
    optional={"content": st.one_of(st.text(max_size=20), _scalar, st.lists(_scalar, max_size=2)),
              "reasoning_content": _scalar, "name": _scalar, "tool_call_id": _scalar,
              "tool_calls": st.one_of(_scalar, st.lists(st.one_of(_scalar, st.fixed_dictionaries(
                  {"function": st.one_of(_scalar, st.fixed_dictionaries(
                      {"name": _scalar}, optional={"arguments": st.one_of(_scalar, st.dictionaries(
                          st.text(max_size=3), _scalar, max_size=2))}))})), max_size=2)),
              "extra": _scalar})


@pytest.fixture(scope="module")
def tok(bf16_ckpt):
    from backend_lib.tokenizer import Tokenizer

    return Tokenizer(bf16_ckpt)


@FUZZ
@given(messages=st.one_of(st.lists(_message, max_size=4), _scalar), thinking=st.booleans())
def test_fuzzed_chat_messages_render_or_get_an_error_naming_messages(tok, messages, thinking):
    raw = json.dumps(messages, allow_nan=False) if not (isinstance(messages, float) and not math.isfinite(messages)) \
        else "null"
    try:
        ids = tokenize_request(tok, 4096, None, raw, enable_thinking=thinking)
    except RequestError as exc:
        assert str(exc).startswith("messages"), exc
        assert "Traceback" not in str(exc) and "/" not in str(exc).split(":")[0]
        return
    assert ids


def test_the_known_conversations_still_render(tok):
    for conv in CONVERSATIONS:
        assert tokenize_request(tok, 4096, None, json.dumps(conv))
