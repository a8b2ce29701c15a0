"""prompt_logprobs: every prompt token's logprob from the prefill's own forward, equal to
LLMEngine.score's exactly, alone, batched, chunked, after a prefix-cache hit would have applied, and
with the tokens of the request unchanged."""
from __future__ import annotations

import pytest

from backend_lib.contract.errors import RequestError
from helpers import make_engine

TEXT = "The quick brown fox jumps over the lazy dog. " * 14  # several 16-token pages, several 64-token chunks
OTHER = [9707, 11, 1879, 0]


def _params(eng, **kw):
    return eng.make_params({"temperature": 0, "max_tokens": 6, "ignore_eos": True, **kw})


def test_prompt_logprobs_equal_score_exactly_alone_and_batched(bf16_engine):
    eng = bf16_engine
    ids = eng.tokenizer.encode(TEXT) + eng.tokenizer.encode(" and again")
    assert len(ids) > 2 * eng.cfg.max_num_batched_tokens   # the prefill is chunked
    scored, top1 = eng.score_detail(ids)
    plain = eng.generate([ids], _params(eng))[0]
    for k in (0, 3):
        alone = eng.generate([ids], _params(eng, prompt_logprobs=k))[0]
        batched = eng.generate([OTHER, ids, OTHER[:2]], [_params(eng), _params(eng, prompt_logprobs=k), _params(eng)])
        assert batched[1] == alone, "prompt logprobs depend on the batch"
        assert alone["output_ids"] == plain["output_ids"], "asking for prompt logprobs changed the tokens"
        plp = alone["prompt_logprobs"]
        assert plp[0] == {"id": ids[0], "logprob": None, "rank": None, "top": []} and len(plp) == len(ids)
        assert [e["id"] for e in plp[1:]] == ids[1:]
        assert [e["logprob"] for e in plp[1:]] == scored[1:]   # exactly: the same numbers
        for e, best in zip(plp[1:], top1):
            assert len(e["top"]) == k
            assert (e["rank"] == 1) == (e["id"] == best)
            if k:
                assert e["top"][0]["id"] == best and e["top"][0]["logprob"] >= e["logprob"]
        assert batched[0]["output_ids"] == eng.generate([OTHER], _params(eng))[0]["output_ids"]
        assert "prompt_logprobs" not in batched[0]


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(bf16_ckpt):
    eng = make_engine(bf16_ckpt, enable_prefix_caching=True)
    ids = eng.tokenizer.encode(TEXT)
    scored = eng.score(ids)
    eng.generate([ids], _params(eng))   # its full pages are now cached
    hits = eng.scheduler.prefix_hits
    res = eng.generate([ids], _params(eng, prompt_logprobs=0))[0]
    assert eng.scheduler.prefix_hits == hits, "the request for prompt logprobs took cached pages"
    assert [e["logprob"] for e in res["prompt_logprobs"][1:]] == scored[1:]
    again = eng.generate([ids], _params(eng))[0]   # the cache still serves others
    assert eng.scheduler.prefix_hits > hits and again["output_ids"] == res["output_ids"]


def test_prompt_logprobs_survive_a_preemption(bf16_ckpt):
    # 6 pages of 16 tokens: 4 concurrent 60-token sequences do not fit; the newest (ours, last) is preempted
    eng = make_engine(bf16_ckpt, kv_cache_memory=6 * 16 * 1024, max_model_len=64, max_num_seqs=4)
    ids = eng.tokenizer.encode(TEXT)[:20]
    scored = eng.score(ids)
    prompts = [eng.tokenizer.encode(f"Story {i}: once upon a time")[:20] for i in range(3)] + [ids]
    alone = eng.generate([ids], _params(eng, prompt_logprobs=1, max_tokens=40))[0]
    res = eng.generate(prompts, [_params(eng, max_tokens=40)] * 3 + [_params(eng, prompt_logprobs=1, max_tokens=40)])
    assert eng.scheduler.num_preemptions > 0, "the pool was meant to run dry"
    assert res[-1] == alone
    assert [e["logprob"] for e in alone["prompt_logprobs"][1:]] == scored[1:] and len(alone["prompt_logprobs"]) == 20


@pytest.mark.parametrize("value", [-1, 21, 2**40, "x", 1.5])
def test_bad_prompt_logprobs_name_the_field(bf16_engine, value):
    with pytest.raises(RequestError, match="prompt_logprobs"):
        bf16_engine.make_params({"prompt_logprobs": value})


def test_prompt_scoring_is_bounded_by_a_budget_named_in_the_error(bf16_ckpt):
    """prompt tokens x (top N + 1) entries at most max_prompt_scoring (default 65536) per request: over it, refused
    naming prompt_logprobs and the limit; at it, admitted."""
    from backend_lib.sampling.params import SamplingLimits

    assert SamplingLimits().max_prompt_scoring == 65536
    eng = make_engine(bf16_ckpt, limits=SamplingLimits(max_prompt_scoring=4200))
    with pytest.raises(RequestError, match=r"^prompt_logprobs: scoring 201 prompt tokens with 20 alternatives each "
                                           r"is 4221 entries, over this model's budget of 4200 \(max_prompt_scoring\)"):
        eng.make_request("big", [9707] * 201, _params(eng, prompt_logprobs=20))
    eng.make_request("ok", [9707] * 200, _params(eng, prompt_logprobs=20, max_tokens=1))   # 4200: admitted
