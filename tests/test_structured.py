"""Structured output: grammar masks in the engine (JSON schema, any JSON object, regex, choice, Lark),
exact ids beside unconstrained requests, errors at admission that name the field, thinking-aware start."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from backend_lib.contract.errors import RequestError
from backend_lib.contract.structured import StructuredSpec, spec_from_sampling

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                               "minItems": 1, "maxItems": 3},
                                      "address": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 8},
                                          "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                          "required": ["city", "zip"], "additionalProperties": False}},
     "required": ["tags", "address"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": -1, "maximum": 1},
                                      "ok": {"type": "boolean"}, "kind": {"const": "point"}},
     "required": ["score", "ok", "kind"], "additionalProperties": False},
]


def _json(schema):
    return {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}


@pytest.fixture(scope="module")
def engine(a8w8_ckpt):
    from helpers import make_engine
    return make_engine(a8w8_ckpt, dtype="bfloat16")


@pytest.fixture(scope="module")
def prompt(engine):
    return engine.tokenizer.encode("Answer in JSON:")


def _run(engine, prompts, datas):
    return engine.generate(prompts, [engine.make_params(d) for d in datas])


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_json_schema_outputs_validate(engine, prompt, temperature):
    datas = [{"temperature": temperature, "seed": i, "max_tokens": 200, **_json(s)} for i, s in enumerate(SCHEMAS)]
    for data, r in zip(datas, _run(engine, [prompt] * len(datas), datas)):
        assert r["finish_reason"] == "stop", r
        jsonschema.validate(json.loads(r["text"]), data["structured_outputs"]["json"])


def test_json_object_outputs_are_objects(engine, prompt):
    """Any JSON object: unbounded strings let a random-weight model write one key forever, so not every
    run ends; every one that ends is an object, and every one is a prefix of one."""
    datas = [{"temperature": 1.0, "seed": i, "max_tokens": 60,
              "structured_outputs": {"json_object": True, "disable_any_whitespace": True}} for i in range(8)]
    results = _run(engine, [prompt] * len(datas), datas)
    assert all(r["text"].startswith("{") for r in results)
    done = [r for r in results if r["finish_reason"] == "stop"]
    assert done and all(isinstance(json.loads(r["text"]), dict) for r in done)


def test_regex_choice_and_lark_outputs_match(engine, prompt):
    datas = [{"temperature": 1.0, "seed": 1, "max_tokens": 50, "structured_outputs": {"regex": r"[a-z]{3}-[0-9]{2,4}"}},
             {"temperature": 1.0, "seed": 2, "max_tokens": 50, "guided_choice": ["alpha", "beta", "gamma delta"]},
             {"temperature": 1.0, "seed": 3, "max_tokens": 50, "ignore_eos": True,
              "structured_outputs": {"grammar": 'start: "sum(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/'}},
             {"temperature": 0, "max_tokens": 50, "guided_regex": "(yes|no)!"}]
    r = _run(engine, [prompt] * 4, datas)
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2,4}", r[0]["text"]) and r[0]["finish_reason"] == "stop"
    assert r[1]["text"] in ("alpha", "beta", "gamma delta") and r[1]["finish_reason"] == "stop"
    # ignore_eos: the grammar's end still ends the request
    assert re.fullmatch(r"sum\([0-9]{1,3}(,[0-9]{1,3})*\)", r[2]["text"]) and r[2]["finish_reason"] == "stop"
    assert r[3]["text"] in ("yes!", "no!")


def test_constrained_and_free_requests_get_their_solo_ids(engine, prompt):
    """Masks touch only their own row: each request gets in a mixed batch the ids it gets alone."""
    other = engine.tokenizer.encode("A different prompt, longer than the first one")
    datas = [{"temperature": 0, "max_tokens": 40, **_json(SCHEMAS[1])},
             {"temperature": 0, "max_tokens": 24, "ignore_eos": True},
             {"temperature": 0.9, "seed": 5, "max_tokens": 40, **_json(SCHEMAS[0])},
             {"temperature": 0.9, "seed": 6, "max_tokens": 24, "ignore_eos": True}]
    prompts = [prompt, other, other, prompt]
    together = _run(engine, prompts, datas)
    for p, d, r in zip(prompts, datas, together):
        assert _run(engine, [p], [d])[0]["output_ids"] == r["output_ids"]


def _accepts(engine, so: dict, text: str) -> bool:
    """Whether the grammar of structured_outputs `so` takes `text` (as the model's tokenizer splits it) and is
    then complete."""
    state = engine.grammar.matcher(StructuredSpec.parse(so), False)
    ids = engine.tokenizer.encode(text)
    return state.matcher.try_consume_tokens(ids) == len(ids) and state.matcher.is_accepting()


INDENTED = '{\n  "name": "Ann",\n  "age": 7\n}'
COMPACT = '{"name":"Ann","age":7}'


@pytest.mark.parametrize("so", [{"json": SCHEMAS[0]}, {"json_object": True}])
def test_default_whitespace_between_json_tokens_is_bounded_as_llama_cpps(engine, so):
    """llama.cpp's `space ::= | " " | "\n" [ \t]{0,20}`: one newline and its indentation, or one space, or
    nothing; never two newlines in a row, nor a run of 40 spaces, so a bounded schema's JSON is bounded."""
    for text in (INDENTED, COMPACT, '{"name": "Ann", "age": 7}', '{\n\t"name": "Ann",\n\t"age": 7\n}',
                 '{\n' + " " * 20 + '"name": "Ann", "age": 7}'):
        assert _accepts(engine, so, text), text
    for text in ('{\n\n  "name": "Ann",\n  "age": 7\n}', '{' + " " * 40 + '"name": "Ann", "age": 7}',
                 '{\n' + " " * 21 + '"name": "Ann", "age": 7}', '{"name":  "Ann", "age": 7}',
                 '{"name": "Ann",\n\n"age": 7}', '{"name": "Ann", "age": 7} ', ' {"name": "Ann", "age": 7}'):
        assert not _accepts(engine, so, text), text
    compact = {**so, "disable_any_whitespace": True}   # compact JSON only
    assert _accepts(engine, compact, COMPACT) and not _accepts(engine, compact, INDENTED)
    assert not _accepts(engine, compact, '{"name": "Ann", "age": 7}')
    own = {**so, "whitespace_pattern": r"[\n ]*"}        # the client's pattern wins
    assert _accepts(engine, own, '{\n\n  "name": "Ann",' + " " * 40 + '"age": 7\n}')


def test_a_bounded_schema_ends_under_the_default_whitespace(engine, prompt):
    """A random-weight model (the weakest there is) sampling freely under each bounded schema, free whitespace
    allowed by default: every JSON ends well within max_tokens and validates."""
    datas = [{"temperature": 1.0, "seed": 10 + i, "max_tokens": 200, "structured_outputs": {"json": s}}
             for i, s in enumerate(SCHEMAS)]
    for data, r in zip(datas, _run(engine, [prompt] * len(datas), datas)):
        assert r["finish_reason"] == "stop", r
        jsonschema.validate(json.loads(r["text"]), data["structured_outputs"]["json"])


@pytest.mark.parametrize("data, field", [
    ({"structured_outputs": {"json": {"type": "strin"}}}, "structured_outputs.json"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}}, "structured_outputs"),
    ({"structured_outputs": {"json": {}, "structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_json"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ({"structured_outputs": {"tool_calls": {"functions": []}}}, "structured_outputs.tool_calls.functions"),
    ({"structured_outputs": {"tool_calls": {"functions": [{"name": ""}]}}},
     "structured_outputs.tool_calls.functions[0].name"),
    ({"structured_outputs": {"tool_calls": {"functions": [{"name": "f", "description": "d"}]}}},
     "structured_outputs.tool_calls.functions[0]"),
    ({"structured_outputs": {"tool_calls": {"functions": [{"name": "f", "parameters": {"type": "strin"}}]}}},
     "structured_outputs.tool_calls"),
    ({"structured_outputs": {"tool_calls": {"functions": [{"name": "f"}], "parallel": "yes"}}},
     "structured_outputs.tool_calls.parallel"),
    ({"structured_outputs": {"tool_calls": {"functions": [{"name": "f"}]}, "disable_any_whitespace": True}},
     "structured_outputs"),
])
def test_bad_constraints_fail_at_admission_naming_the_field(engine, prompt, data, field):
    with pytest.raises(RequestError, match=re.escape(field)):
        engine.make_request("bad", prompt, engine.make_params({"max_tokens": 5, **data}))


def test_a_complete_grammar_ends_the_request_even_under_min_tokens(engine, prompt):
    """Nothing may follow a complete grammar, so its end wins over min_tokens (and ignore_eos); the request
    beside it is untouched."""
    datas = [{"temperature": 0, "max_tokens": 10, "min_tokens": 5, "ignore_eos": True, "guided_choice": ["x"]},
             {"temperature": 0, "max_tokens": 6, "ignore_eos": True}]
    bad, good = _run(engine, [prompt] * 2, datas)
    assert (bad["text"], bad["finish_reason"]) == ("x", "stop")
    assert good["output_ids"] == _run(engine, [prompt], datas[1:])[0]["output_ids"]


def test_thinking_chat_constrains_after_the_think_block(engine):
    """Thinking on: the prompt ends in an open assistant turn, the grammar waits for `</think>`; thinking off
    (an empty think block closed in the prompt): the grammar applies from the first token."""
    tok = engine.tokenizer
    msgs = [{"role": "user", "content": "hi"}]
    on = tok.encode(tok.apply_chat_template(msgs, enable_thinking=True))
    off = tok.encode(tok.apply_chat_template(msgs, enable_thinking=False))
    assert tok.thinking_open(on) and not tok.thinking_open(off)
    assert not tok.thinking_open(tok.encode("plain text, no chat"))
    spec = StructuredSpec.parse({"choice": ["yes", "no"]})
    state = engine.grammar.matcher(spec, tok.thinking_open(on))
    assert not state.active
    assert state.accept(tok.encode("free")[0]) is False and not state.active   # not checked while thinking
    assert state.accept(tok.think_end_id) is False and state.active
    r = _run(engine, [off], [{"temperature": 0, "max_tokens": 8, "guided_choice": ["yes", "no"]}])[0]
    assert r["text"] in ("yes", "no")


_json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                            lambda c: st.lists(c, max_size=3) | st.dictionaries(
                                st.text(max_size=8) | st.sampled_from(["functions", "parallel", "name", "parameters",
                                                                       "type"]), c, max_size=3),
                            max_leaves=8)
_keys = st.sampled_from(["json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
                         "whitespace_pattern", "backend", "type", "structural_tag", "tool_calls", "functions",
                         "parallel", "name", "parameters"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(_keys, _json_values, max_size=3) | _json_values)
def test_fuzzed_structured_outputs_fail_alone_with_a_request_error(engine, prompt, value):
    """Whatever a client puts in structured_outputs: a spec that compiles, or a RequestError; nothing else."""
    try:
        rest, spec = spec_from_sampling({"structured_outputs": value})
        if spec is not None:
            engine.grammar.matcher(spec, False)
    except RequestError:
        pass


def test_fill_masks_gives_the_mask_after_each_draft_prefix_and_leaves_the_grammar_as_it_was(engine, prompt):
    """Speculative verification's masks (GrammarState.fill_masks): position p's mask is the one the grammar gives
    after accepting the first p draft tokens; the grammar is left where it was; past a draft token it does not
    allow, positions are not masked (never sampled)."""
    import torch

    def grammar():
        return engine.make_request("g", prompt, engine.make_params(
            {"structured_outputs": {"regex": "(abc|abd)[0-9]{2}"}})).grammar
    W = (engine.vocab_size + 31) // 32
    draft = engine.tokenizer.encode("abd42")
    g = grammar()
    out = torch.zeros((len(draft) + 1, W), dtype=torch.int32)
    assert g.fill_masks(draft, out) == [True] * (len(draft) + 1)
    step, expect = grammar(), torch.zeros((len(draft) + 1, W), dtype=torch.int32)
    for p in range(len(draft) + 1):
        step.fill_mask(expect[p])
        if p < len(draft):
            step.accept(draft[p])
    assert torch.equal(out, expect)
    again = torch.zeros(W, dtype=torch.int32)
    g.fill_mask(again)
    assert torch.equal(again, expect[0])                     # the grammar left as it was
    bad = [draft[0], engine.tokenizer.encode("z")[0], draft[-1]]
    masked = g.fill_masks(bad, torch.zeros((4, W), dtype=torch.int32))
    assert masked == [True, True, False, False]
    g.fill_mask(again)
    assert torch.equal(again, expect[0])


def test_json_integers_are_bounded_to_16_digits_by_default_a_schemas_own_bounds_winning(engine):
    """llama.cpp's integral part `[1-9] [0-9]{0,15}`: an integer with no bound of its own takes at most 16 digits
    (a random model once wrote a 64-digit one); a schema's own bounds win; numbers keep exponents and -0."""
    from backend_lib.contract.structured import INTEGER_BOUND, bound_integers

    plain = {"json": {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"}}}}
    assert _accepts(engine, plain, '{"n": 9999999999999999, "x": 1e5}')
    assert _accepts(engine, plain, '{"n": -9999999999999999, "x": -0}')
    assert not _accepts(engine, plain, '{"n": 12345678901234567, "x": 1}')
    assert not _accepts(engine, plain, '{"n": ' + "1" * 64 + ', "x": 1}')
    own = {"json": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 10**18}}}}
    assert _accepts(engine, own, '{"n": 123456789012345678}')    # its own maximum wins (18 digits)
    assert not _accepts(engine, own, '{"n": -1}')
    assert bound_integers({"type": "integer", "minimum": 10**18}) == {"type": "integer", "minimum": 10**18}
    nested = bound_integers({"anyOf": [{"type": ["integer", "null"]}], "items": {"type": "integer"},
                             "const": {"type": "integer"}, "$defs": {"a": {"type": "integer", "maximum": 5}}})
    assert nested["anyOf"][0]["maximum"] == INTEGER_BOUND and nested["items"]["minimum"] == -INTEGER_BOUND
    assert nested["const"] == {"type": "integer"}    # data, not a schema: untouched
    assert nested["$defs"]["a"] == {"type": "integer", "maximum": 5, "minimum": -INTEGER_BOUND}


def _masked_accepts(engine, so: dict, text: str) -> bool:
    """Whether `text` (as the tokenizer splits it) gets through the request's masks token by token (the grammar's
    and the digit bound on top of it) and completes the grammar."""
    import torch

    state = engine.grammar.matcher(StructuredSpec.parse(so), False)
    mask = torch.zeros((engine.vocab_size + 31) // 32, dtype=torch.int32)
    for tok in engine.tokenizer.encode(text):
        state.fill_mask(mask)
        if not (int(mask[tok >> 5]) >> (tok & 31)) & 1:
            return False
        state.accept(tok)
    return state.matcher.is_accepting()


def test_every_part_of_a_json_number_is_bounded_to_16_digits_strings_and_a_schemas_own_numbers_not(engine, prompt):
    """llama.cpp's integral, fraction and exponent parts of at most 16 digits each, for numbers too (llguidance
    1.9 has no option for it: backend_lib/sampling/json_digits.py): in a json schema, json_object and tool calls;
    digits inside strings are not bounded, and a schema that names a longer number keeps its own. A random model
    pushed to write digits (logit_bias +100 on every digit) ends its number within the bounds."""
    num = {"json": {"type": "object", "properties": {"x": {"type": "number"}, "s": {"type": "string"}},
                    "required": ["x"]}}
    d16, d17 = "1" * 16, "1" * 17
    for text in (f'{{"x": {d16}.{d16}e-{d16}}}', f'{{"x": -0.{d16}E+7}}', f'{{"x": 1e{d16}, "s": "{d17 * 3}"}}'):
        assert _masked_accepts(engine, num, text), text
    for text in (f'{{"x": 1.{d17}}}', f'{{"x": 1e{d17}}}', f'{{"x": {d17}}}'):
        assert _accepts(engine, num, text), "llguidance alone takes it"
        assert not _masked_accepts(engine, num, text), text
    obj = {"json_object": True}
    assert _masked_accepts(engine, obj, f'{{"a": [{d16}.5, "{d17}"]}}')
    assert not _masked_accepts(engine, obj, f'{{"a": [{d17}.5]}}')
    own = {"json": {"type": "integer", "minimum": 0, "maximum": 10**18}}
    assert _masked_accepts(engine, own, "123456789012345678")   # the schema names a 19-digit bound: its own wins
    digits = {str(i): 100 for i in engine.tokenizer.encode("0123456789")}
    assert len(digits) == 10
    data = {"temperature": 1.0, "seed": 3, "max_tokens": 120, "logit_bias": digits,
            "structured_outputs": {"json": {"type": "number"}}}
    unbounded = {**data, "structured_outputs": {"json": own["json"]}}
    got, free = _run(engine, [prompt, prompt], [data, unbounded])
    assert got["finish_reason"] == "stop", got
    parts = re.fullmatch(r"-?([0-9]+)(?:\.([0-9]+))?(?:[eE][+-]?([0-9]+))?", got["text"])
    assert parts and all(len(p) <= 16 for p in parts.groups() if p), got["text"]
    assert len(free["text"]) > 16 and free["text"].isdigit(), free   # its own bound: more than 16 digits
