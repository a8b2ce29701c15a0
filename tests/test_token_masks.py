"""logit_bias, allowed_token_ids and bad_words: applied in the sampler row by row (batch invariant: a
request's tokens are the same alone and beside others), exact (greedy picks the argmax of the biased
logits), and a hostile value fails that request alone with an error naming the field."""
from __future__ import annotations

import pytest
import torch

from backend_lib.contract.errors import RequestError
from backend_lib.contract.fields import SamplingLimits
from backend_lib.sampling import Sampler, SamplingParams
from backend_lib.sampling.params import bad_words_token_ids

REF_PROMPTS = [[9707, 11, 1879, 0], [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]]


def _greedy(eng, n=10, **kw):
    return eng.make_params({"temperature": 0, "max_tokens": n, "ignore_eos": True, **kw})


@pytest.fixture(scope="module")
def references(bf16_engine):
    return [bf16_engine.generate([p], _greedy(bf16_engine))[0]["output_ids"] for p in REF_PROMPTS]


def _alone_and_batched(eng, prompt, params, references):
    """The request alone, then in one batch with the greedy references (which must keep their ids)."""
    alone = eng.generate([prompt], params)[0]
    results = eng.generate(REF_PROMPTS + [prompt], [_greedy(eng)] * len(REF_PROMPTS) + [params])
    assert [r["output_ids"] for r in results[:-1]] == references, "a request beside it changed its tokens"
    assert results[-1] == alone, "the request's tokens depend on its batch"
    assert eng.block_manager.num_used == 0 and not eng.has_unfinished()
    return alone


class _Seq:
    def __init__(self, params, output=()):
        self.params, self.prompt_ids, self.output_ids = params, [1], list(output)
        self.min_tokens_blocked_ids = [0]
        self.generator = torch.Generator().manual_seed(0)
        self.grammar = None


def _p(**kw):
    return SamplingParams(**kw).validate(SamplingLimits(), 8)


def test_sampler_applies_each_mask_to_its_row_only():
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.5, 0, 0, 0, 0]] * 4)
    params = [_p(temperature=0), _p(temperature=0, logit_bias={"3": 4.6}), _p(temperature=0, allowed_token_ids=[2, 6]),
              _p(temperature=0)]
    params[3].bad_words_ids = [[1], [7, 2]]
    out = Sampler()(logits, [_Seq(p) for p in params])
    assert [o.token_id for o in out] == [1, 3, 2, 2]
    bw = _p(temperature=0)
    bw.bad_words_ids = [[7, 1]]   # two-token bad word: only after 7
    assert Sampler()(logits[:1], [_Seq(bw, output=[7])])[0].token_id == 2
    assert Sampler()(logits[:1], [_Seq(bw, output=[5])])[0].token_id == 1


def test_greedy_with_logit_bias_is_the_argmax_of_the_biased_logits(bf16_engine, references):
    eng = bf16_engine
    ids = REF_PROMPTS[1]
    first = references[1][0]
    # -100 on the greedy choice: the first token is the second most likely one, exactly
    logp, top1 = eng.score_detail(ids + [first])
    res = _alone_and_batched(eng, ids, _greedy(eng, logit_bias={str(first): -100}), references)
    assert res["output_ids"][0] != first
    for tok in res["output_ids"]:
        assert tok != first
    # +100 on a token the model does not pick: it is picked at every step
    target = 1234
    res = _alone_and_batched(eng, ids, _greedy(eng, logit_bias={str(target): 100}), references)
    assert res["output_ids"] == [target] * 10


def test_allowed_token_ids_restrict_greedy_and_sampled_choices(bf16_engine, references):
    eng = bf16_engine
    allowed = [references[0][3], 500, 77]
    res = _alone_and_batched(eng, REF_PROMPTS[0], _greedy(eng, allowed_token_ids=allowed), references)
    assert set(res["output_ids"]) <= set(allowed)
    sampled = eng.make_params({"temperature": 1.5, "seed": 11, "max_tokens": 10, "ignore_eos": True,
                               "allowed_token_ids": allowed})
    res = _alone_and_batched(eng, REF_PROMPTS[0], sampled, references)
    assert set(res["output_ids"]) <= set(allowed) and len(res["output_ids"]) == 10


def _first_word(tok, ref, width):
    """The first `width` tokens of `ref` that, decoded, are a bad word whose token sequence they are."""
    for i in range(len(ref) - width + 1):
        word = tok.decode(ref[i:i + width])
        if ref[i:i + width] in bad_words_token_ids([word], tok.encode):
            return i, word
    raise AssertionError("no reference token round-trips through the tokenizer")


def test_bad_words_are_never_generated(bf16_engine, references):
    eng = bf16_engine
    ref = references[0]
    i, word = _first_word(eng.tokenizer, ref, 1)   # a one-token word: banned everywhere
    res = _alone_and_batched(eng, REF_PROMPTS[0], _greedy(eng, bad_words=[word]), references)
    assert res["output_ids"][:i] == ref[:i] and res["output_ids"][i] != ref[i]
    assert ref[i] not in res["output_ids"]
    i, word = _first_word(eng.tokenizer, ref, 2)   # two tokens: the second is banned right after the first only
    res = _alone_and_batched(eng, REF_PROMPTS[0], _greedy(eng, bad_words=[word]), references)
    out = res["output_ids"]
    assert out[:i + 1] == ref[:i + 1] and out[i + 1] != ref[i + 1]
    assert all(out[j:j + 2] != ref[i:i + 2] for j in range(len(out) - 1))


@pytest.mark.parametrize("fields, name", [
    ({"logit_bias": {str(i): 1 for i in range(10**4)}}, "logit_bias"),
    ({"logit_bias": {"-1": 5}}, "logit_bias"),
    ({"logit_bias": {str(10**9): 5}}, "logit_bias"),
    ({"logit_bias": {"5": 1e300}}, "logit_bias"),
    ({"logit_bias": {"5": -101}}, "logit_bias"),
    ({"logit_bias": {"5": "high"}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": list(range(10**6))}, "allowed_token_ids"),
    ({"allowed_token_ids": ["a"]}, "allowed_token_ids"),
    ({"bad_words": ["x"] * 1000}, "bad_words"),
    ({"bad_words": ["x" * 10**4]}, "bad_words"),
    ({"bad_words": [3]}, "bad_words"),
])
def test_hostile_values_name_the_field(bf16_engine, fields, name):
    with pytest.raises(RequestError, match=name):
        bf16_engine.make_params(fields)


@pytest.mark.parametrize("fields", [
    {"logit_bias": {str(i): 100 for i in range(1024)}},
    {"logit_bias": {str(i): -100 for i in range(1024)}, "temperature": 1e4, "seed": 3},
    {"allowed_token_ids": [5], "min_tokens": 3},
    {"allowed_token_ids": list(range(151643, 151670)), "bad_words": ["the", " a"], "temperature": 0.7, "seed": 1},
])
def test_extreme_valid_masks_serve_that_request_alone(bf16_engine, references, fields):
    eng = bf16_engine
    params = eng.make_params({"max_tokens": 6, "ignore_eos": True, "seed": 5, **fields})
    res = _alone_and_batched(eng, REF_PROMPTS[0], params, references)
    assert res["error"] is None and len(res["output_ids"]) == 6


def test_a_mask_that_forbids_every_token_fails_that_request_alone(bf16_engine, references):
    eng = bf16_engine
    end = sorted(eng.end_ids)[0]
    params = eng.make_params({"max_tokens": 6, "min_tokens": 3, "allowed_token_ids": [end], "temperature": 0})
    res = _alone_and_batched(eng, REF_PROMPTS[0], params, references)
    assert res["finish_reason"] == "error" and "allowed_token_ids" in res["error"]
