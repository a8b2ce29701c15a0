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


def _run_counting_steps(eng, requests):
    """requests: (id, prompt ids, params) added in order before the first step; runs to completion. Returns each
    request's result, the step each finished at and the scored prompt rows of every step."""
    res = {rid: {"output_ids": [], "prompt_logprobs": None, "finish_reason": None} for rid, _, _ in requests}
    for rid, ids, p in requests:
        eng.add_request(rid, ids, p)
    finished, scored_rows, step = {}, [], 0
    plan_of = eng.scheduler.next_step

    def recording():
        plan = plan_of()
        scored_rows.append(sum(n for seq, n in plan.seqs if seq.scoring))
        return plan
    eng.scheduler.next_step = recording
    try:
        while eng.has_unfinished():
            step += 1
            for out in eng.step():
                r = res[out.request_id]
                r["output_ids"] += out.new_token_ids
                if out.prompt_logprobs is not None:
                    r["prompt_logprobs"] = out.prompt_logprobs
                if out.finished:
                    r["finish_reason"], finished[out.request_id] = out.finish_reason, step
    finally:
        del eng.scheduler.next_step
    return res, finished, scored_rows


def test_a_big_scoring_request_leaves_the_others_their_share_with_the_same_bits(bf16_ckpt):
    """Four long prompts scored with top 5 (a 4-choice scoring request) queued before a short greedy request:
    scoring takes at most max_scoring_tokens_per_step prompt rows a step and the short request is admitted at
    once, finishing after max_tokens steps with its solo ids; with the share at the whole step (the old
    scheduling) it waited for every scoring prefill. The scored logprobs and every generated id are the same
    bits either way, and score()'s."""
    eng = make_engine(bf16_ckpt, max_num_batched_tokens=32, max_scoring_tokens_per_step=8)
    assert eng.scheduler.max_scoring_tokens == 8
    ids = eng.tokenizer.encode(TEXT)[:72]
    prompts = [ids[i:] + ids[:i] for i in range(4)]
    short = eng.tokenizer.encode("Hello there")[:3]
    requests = [(f"score{i}", p, _params(eng, prompt_logprobs=5, max_tokens=3)) for i, p in enumerate(prompts)]
    requests.append(("short", short, _params(eng, max_tokens=4)))
    alone = eng.generate([short], _params(eng, max_tokens=4))[0]["output_ids"]
    new, new_steps, new_rows = _run_counting_steps(eng, requests)
    eng.scheduler.max_scoring_tokens = eng.cfg.max_num_batched_tokens   # the old scheduling: no share
    old, old_steps, old_rows = _run_counting_steps(eng, requests)
    assert new["short"]["output_ids"] == alone == old["short"]["output_ids"]
    assert new_steps["short"] <= 4 + 1, new_steps      # admitted in the first step, one token a step
    # without the share it is admitted only once the last scoring prompt is (4 x 72 prompt rows at 32 a step)
    assert old_steps["short"] >= 4 + 4 * 72 // 32 - 1 > new_steps["short"] + 5, old_steps
    assert max(new_rows) == 8 and max(old_rows) == 32
    for i, p in enumerate(prompts):
        r, o = new[f"score{i}"], old[f"score{i}"]
        assert r == o, "chunking the scoring changed its bits"
        assert len(r["prompt_logprobs"]) == len(p) and all(len(e["top"]) == 5 for e in r["prompt_logprobs"][1:])
    assert [e["logprob"] for e in new["score1"]["prompt_logprobs"][1:]] == eng.score(prompts[1])[1:]
    assert eng.block_manager.num_used == 0
