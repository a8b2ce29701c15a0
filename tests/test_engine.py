"""The engine against transformers, and its batching guarantees (continuous batching, preemption, seeds)."""
from __future__ import annotations

import pytest
import torch

from backend_lib.contract.errors import RequestError
from helpers import make_engine

PROMPTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. " * 6,          # longer than one 16-token page
    "介绍一下北京故宫，它有多少年的历史？",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 3,
]


def greedy(engine, max_tokens=24, **kw):
    return engine.make_params({"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, **kw})


@pytest.fixture(scope="module")
def hf_model(bf16_ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(bf16_ckpt), dtype=torch.float32).eval()


def test_greedy_equals_transformers_generate(bf16_engine, hf_model):
    eng = bf16_engine
    prompts = [eng.tokenizer.encode(p) for p in PROMPTS]
    assert max(len(p) for p in prompts) > 3 * 16, "a prompt must span several pages"
    results = eng.generate(prompts, greedy(eng, 24))
    for ids, res in zip(prompts, results):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
        expected = out[0, len(ids):].tolist()
        assert res["output_ids"] == expected
        assert len(set(expected)) > 4, "degenerate test model: greedy output repeats one token"


def test_score_equals_transformers_logprobs(bf16_engine, hf_model):
    ids = bf16_engine.tokenizer.encode(PROMPTS[1])
    ours = bf16_engine.score(ids)
    assert ours[0] is None and len(ours) == len(ids)
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(ours[1:]), ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("which", ["bf16", "a8w8"])
def test_concurrent_generation_equals_solo(which, bf16_engine, a8w8_engine):
    eng = bf16_engine if which == "bf16" else a8w8_engine
    prompts = [eng.tokenizer.encode(p) for p in PROMPTS] + [eng.tokenizer.encode("Once upon a time")]
    params = greedy(eng, 20)
    solo = [eng.generate([p], params)[0]["output_ids"] for p in prompts]
    together = [r["output_ids"] for r in eng.generate(prompts, params)]
    assert together == solo


def test_requests_join_a_running_batch(bf16_engine):
    eng = bf16_engine
    p1, p2 = eng.tokenizer.encode(PROMPTS[0]), eng.tokenizer.encode(PROMPTS[1])
    params = greedy(eng, 16)
    solo1 = eng.generate([p1], params)[0]["output_ids"]
    solo2 = eng.generate([p2], params)[0]["output_ids"]
    eng.add_request("a", p1, params)
    got = {"a": [], "b": []}
    for step in range(200):
        if step == 5:
            eng.add_request("b", p2, params)   # arrives while "a" decodes
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
        if not eng.has_unfinished():
            break
    assert got == {"a": solo1, "b": solo2}


def test_tiny_page_pool_preempts_and_every_request_completes_identically(bf16_ckpt):
    # 6 pages of 16 tokens: a single 64-token max-length sequence fits, 4 concurrent ones do not
    eng = make_engine(bf16_ckpt, kv_cache_memory=6 * 16 * 1024, max_model_len=64, max_num_seqs=4)
    assert eng.runner.kv_cache.num_pages == 6
    prompts = [eng.tokenizer.encode(p)[:20] for p in PROMPTS]
    params = greedy(eng, 40)
    solo = [eng.generate([p], params)[0] for p in prompts]
    before = eng.scheduler.num_preemptions
    together = eng.generate(prompts, params)
    assert eng.scheduler.num_preemptions > before, "the pool was meant to run dry"
    assert [r["output_ids"] for r in together] == [r["output_ids"] for r in solo]
    assert [r["text"] for r in together] == [r["text"] for r in solo]
    assert eng.block_manager.num_used == 0


def test_chunked_prefill_equals_whole_prompt(bf16_ckpt):
    small = make_engine(bf16_ckpt, max_num_batched_tokens=8, max_num_seqs=2)
    big = make_engine(bf16_ckpt, max_num_batched_tokens=512, max_num_seqs=2)
    ids = small.tokenizer.encode(PROMPTS[1])
    assert small.score(ids) == big.score(ids)
    assert small.generate([ids], greedy(small, 12))[0]["output_ids"] == big.generate([ids], greedy(big, 12))[0]["output_ids"]


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(bf16_engine):
    eng = bf16_engine
    ids = eng.tokenizer.encode("Tell me a story")
    sampled = eng.make_params({"temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 1234, "max_tokens": 16,
                               "ignore_eos": True})
    a = eng.generate([ids], sampled)[0]["output_ids"]
    others = [eng.make_params({"temperature": 0.7, "seed": s, "max_tokens": 16, "ignore_eos": True}) for s in (1, 2)]
    b = eng.generate([ids, eng.tokenizer.encode(PROMPTS[2]), ids], [sampled] + others)[0]["output_ids"]
    assert a == b
    c = eng.generate([ids], eng.make_params({"temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 99,
                                             "max_tokens": 16, "ignore_eos": True}))[0]["output_ids"]
    assert c != a


def test_stop_string_split_across_tokens_stops_and_is_not_returned(bf16_engine):
    eng = bf16_engine
    ids = eng.tokenizer.encode(PROMPTS[0])
    free = eng.generate([ids], greedy(eng, 24))[0]
    text = free["text"]
    # find a stop string that straddles a token boundary in the free-running text
    pieces = [eng.tokenizer.decode([t]) for t in free["output_ids"]]
    pos = len(pieces[0]) + len(pieces[1]) + len(pieces[2])
    stop = text[pos - 2:pos + 2]
    assert len(stop) == 4 and text.find(stop) == pos - 2
    res = eng.generate([ids], greedy(eng, 24, stop=[stop]))[0]
    assert res["finish_reason"] == "stop"
    assert res["text"] == text[:pos - 2]
    assert stop not in res["text"]


def test_eos_stops_generation(bf16_engine):
    eng = bf16_engine
    ids = eng.tokenizer.encode(PROMPTS[0])
    first = eng.generate([ids], greedy(eng, 8))[0]["output_ids"]
    # make the 3rd greedy token a stop token: generation must end there with reason stop
    res = eng.generate([ids], greedy(eng, 8, ignore_eos=False, stop_token_ids=[first[2]]))[0]
    assert res["output_ids"] == first[:3] and res["finish_reason"] == "stop"
    res = eng.generate([ids], greedy(eng, 8, stop_token_ids=[first[2]], min_tokens=4))[0]
    assert len(res["output_ids"]) >= 4 and first[2] not in res["output_ids"][:4]


def test_abort_frees_pages_at_once(bf16_engine):
    eng = bf16_engine
    eng.add_request("x", eng.tokenizer.encode(PROMPTS[1]), greedy(eng, 50))
    for _ in range(3):
        eng.step()
    assert eng.block_manager.num_used > 0
    out = eng.abort("x")
    assert out.finished and out.finish_reason == "cancelled"
    assert eng.block_manager.num_used == 0 and not eng.has_unfinished()


def test_logprobs_of_chosen_and_top_alternatives(bf16_engine, hf_model):
    eng = bf16_engine
    ids = eng.tokenizer.encode(PROMPTS[0])
    eng.add_request("lp", ids, greedy(eng, 1, logprobs=3))
    out = eng.step()[0]
    lp = out.new_logprobs[0]
    assert lp["id"] == out.new_token_ids[0] and len(lp["top"]) == 3
    assert lp["top"][0]["id"] == lp["id"] and lp["top"][0]["logprob"] == pytest.approx(lp["logprob"])
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, -1].float(), -1)
    assert lp["logprob"] == pytest.approx(ref.max().item(), abs=1e-4)


def test_request_validation_names_the_field(bf16_engine):
    eng = bf16_engine
    with pytest.raises(RequestError, match="prompt is empty"):
        eng.add_request("e1", [], greedy(eng))
    with pytest.raises(RequestError, match="input_ids"):
        eng.add_request("e2", [1, 2, 10**7], greedy(eng))
    with pytest.raises(RequestError, match="max_model_len"):
        eng.add_request("e3", [5] * 2000, greedy(eng))
    for bad, field in [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
                       ({"temperature": float("nan")}, "temperature"), ({"top_p": 0}, "top_p"),
                       ({"top_k": -2}, "top_k"), ({"stop": ["x"] * 100}, "stop"), ({"bogus": 1}, "bogus")]:
        with pytest.raises(RequestError, match=field):
            eng.make_params(bad)
    assert not eng.has_unfinished()


def test_max_tokens_and_max_model_len_give_length(bf16_ckpt):
    eng = make_engine(bf16_ckpt, max_model_len=40)
    ids = eng.tokenizer.encode(PROMPTS[1])[:30]
    with pytest.raises(RequestError, match="max_tokens"):   # explicit: an error beyond the context (vLLM)
        eng.generate([ids], greedy(eng, 100))
    params = eng.make_params({"temperature": 0, "ignore_eos": True})   # the default max_tokens: capped
    res = eng.generate([ids], params)[0]
    assert res["finish_reason"] == "length" and len(res["output_ids"]) == 10


def test_max_model_len_follows_the_checkpoint_capped_by_the_kv_budget(bf16_ckpt):
    from backend_lib.kv_cache import DenseKVCache

    eng = make_engine(bf16_ckpt, max_model_len=None)
    positions = eng.model_config.max_position_embeddings
    assert eng.max_model_len == positions                           # 64 MiB holds the tiny model's 4096
    mc = eng.model_config
    per_token = DenseKVCache.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, eng.dtype)
    small = make_engine(bf16_ckpt, max_model_len=None, kv_cache_memory=per_token * 300)
    assert small.max_model_len == 288                               # whole 16-token pages that 300 tokens hold
    with pytest.raises(ValueError, match="max_model_len"):
        make_engine(bf16_ckpt, max_model_len=positions + 1)


def test_min_tokens_above_the_effective_max_tokens_is_an_error(bf16_engine):
    eng = bf16_engine
    with pytest.raises(RequestError, match="min_tokens"):
        eng.make_request("m", [1, 2], eng.make_params({"min_tokens": eng.cfg.default_max_tokens + 1}))
    eng.make_request("m", [1, 2], eng.make_params({"min_tokens": eng.cfg.default_max_tokens}))


def test_vllm_neutral_keys_are_accepted_and_others_named(bf16_engine):
    eng = bf16_engine
    eng.make_params({"n": 1, "best_of": 1, "min_p": 0.0, "logit_bias": {}, "use_beam_search": False,
                     "length_penalty": 1.0, "prompt_logprobs": None})
    for key, value in [("n", 2), ("best_of", 3), ("use_beam_search", True)]:
        with pytest.raises(RequestError, match=repr(key)):
            eng.make_params({key: value})


def test_max_tokens_beyond_the_context_is_an_error_naming_it_not_a_clamp(bf16_engine):
    eng = bf16_engine
    prompt = list(range(100, 100 + eng.max_model_len - 10))
    with pytest.raises(RequestError, match="max_tokens: 11 exceeds the 10 tokens left"):
        eng.make_request("m", prompt, eng.make_params({"max_tokens": 11}))
    assert eng.make_request("m", prompt, eng.make_params({"max_tokens": 10})).max_tokens == 10
    assert eng.make_request("m", prompt, eng.make_params({})).max_tokens == 10   # the default is still capped
