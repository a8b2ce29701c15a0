"""Prefix caching: full KV pages cached by content, reused by later prompts, exactly.

A request served from cached pages must produce the ids it produces with the cache off: both caches,
both weight formats, alone, in a batch, across chunked prefill, after preemption and eviction."""
from __future__ import annotations

import pytest

from backend_lib.kv_cache import BlockManager
from helpers import make_engine

S = 16   # page size of the test engines
SYSTEM = list(range(1000, 1000 + 3 * S + 5))          # a shared "system prompt": 3 full pages and a bit
QUESTIONS = [[7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17], [21] * 20, [3, 1, 4, 1, 5, 9, 2, 6]]


def greedy(eng, n=10, **kw):
    return eng.make_params({"temperature": 0, "max_tokens": n, "ignore_eos": True, **kw})


def ids(results):
    return [r["output_ids"] for r in results]


# ----- the page allocator ------------------------------------------------------------------------
def test_block_manager_caches_full_pages_and_evicts_least_recently_used():
    bm = BlockManager(4, S, enable_prefix_caching=True)
    a: list[int] = []
    bm.grow(a, 2 * S)
    bm.register(a[0], b"h0")
    bm.register(a[1], b"h1")
    assert bm.match([b"h0", b"h1", b"h2"]) == a and bm.num_cached == 2
    b = bm.match([b"h0"])
    assert bm.cost_of(b) == 0          # held by `a`: taking it costs no free page
    bm.acquire(b)
    bm.free(a)                         # h1's page is evictable now; h0's is still held by b
    assert bm.num_used == 1 and bm.num_free == 3 and bm.num_cached == 2
    bm.free(b)
    assert bm.num_used == 0 and bm.num_free == 4
    c: list[int] = []
    bm.grow(c, 2 * S)                  # the two never-used pages first: nothing evicted
    assert bm.num_cached == 2
    bm.grow(c, 3 * S)                  # then the least recently released cached page: h1 (the tail) first
    assert bm.match([b"h0", b"h1"]) == [bm.match([b"h0"])[0]] and bm.num_cached == 1
    bm.register(c[0], b"h0")           # the same content twice is cached once
    assert bm.num_cached == 1


def test_caching_off_caches_nothing():
    bm = BlockManager(2, S)
    t: list[int] = []
    bm.grow(t, S)
    bm.register(t[0], b"h")
    assert bm.match([b"h"]) == [] and bm.num_cached == 0


# ----- exactness, cache on vs off -----------------------------------------------------------------
COMBOS = [("bf16_ckpt", "bf16", "float32"), ("bf16_ckpt", "tq", "float32"), ("a8w8_ckpt", "bf16", "bfloat16"),
          ("a8w8_ckpt", "tq", "bfloat16")]


@pytest.fixture(scope="module", params=COMBOS, ids=[f"{c[0][:-5]}-{c[1]}" for c in COMBOS])
def pair(request):
    ckpt = request.getfixturevalue(request.param[0])
    kw = dict(kv_cache=request.param[1], dtype=request.param[2])
    return make_engine(ckpt, enable_prefix_caching=True, **kw), make_engine(ckpt, enable_prefix_caching=False, **kw)


def test_cached_prefix_gives_the_cold_ids_alone_and_in_a_batch(pair):
    on, off = pair
    prompts = [SYSTEM + q for q in QUESTIONS]
    cold = [ids(off.generate([p], greedy(off)))[0] for p in prompts]
    hits_before = on.stats.prefix_cache_hits
    assert ids(on.generate([prompts[0]], greedy(on))) == cold[:1]        # fills the cache
    assert [ids(on.generate([p], greedy(on)))[0] for p in prompts[1:]] == cold[1:]
    assert on.stats.prefix_cache_hits - hits_before >= 3 * S * 3      # each later prompt found 3 pages
    assert ids(on.generate(prompts, greedy(on))) == cold               # all together, from the cache
    seeded = on.make_params({"temperature": 0.8, "top_p": 0.9, "seed": 7, "max_tokens": 10, "ignore_eos": True})
    assert ids(on.generate(prompts, seeded)) == ids(off.generate(prompts, off.make_params(
        {"temperature": 0.8, "top_p": 0.9, "seed": 7, "max_tokens": 10, "ignore_eos": True})))
    assert on.block_manager.num_used == 0 and on.stats.pages_cached > 0


def test_the_next_turn_of_a_chat_reuses_the_pages_its_answer_filled(pair):
    on, off = pair
    turn1 = SYSTEM + [5, 6, 7]
    answer = ids(on.generate([turn1], greedy(on, 40)))[0]
    assert answer == ids(off.generate([turn1], greedy(off, 40)))[0]
    turn2 = turn1 + answer + [42, 43]
    before = on.stats.prefix_cache_hits
    assert ids(on.generate([turn2], greedy(on))) == ids(off.generate([turn2], greedy(off)))
    # every full page of the history, the answer's included, except the one with the answer's last token
    # (its K/V were never computed: the request ended when that token was sampled)
    assert on.stats.prefix_cache_hits - before == (len(turn1) + len(answer) - 1) // S * S


def test_salts_isolate_tenants(bf16_ckpt):
    eng = make_engine(bf16_ckpt, enable_prefix_caching=True)
    p = SYSTEM + [1, 2]
    eng.generate([p], greedy(eng, 2, cache_salt="tenant-a"))
    before = eng.stats.prefix_cache_hits
    eng.generate([p], greedy(eng, 2, cache_salt="tenant-b"))
    eng.generate([p], greedy(eng, 2))
    assert eng.stats.prefix_cache_hits == before        # another salt, or none: nothing shared
    eng.generate([p], greedy(eng, 2, cache_salt="tenant-a"))
    assert eng.stats.prefix_cache_hits == before + len(p) - 1   # its full pages, and its partial page by copy


def test_chunked_prefill_preemption_and_eviction_stay_exact(bf16_ckpt):
    kw = dict(max_num_batched_tokens=24, kv_cache_memory=str(12 * S * 2 * 2 * 2 * 32 * 4), max_model_len=128,
              max_num_seqs=4)
    on = make_engine(bf16_ckpt, enable_prefix_caching=True, **kw)
    off = make_engine(bf16_ckpt, enable_prefix_caching=False, **kw)
    assert on.block_manager.num_pages == 12
    prompts = [SYSTEM + q for q in QUESTIONS] + [list(range(2000, 2050))]
    params = [greedy(on, 30)] * len(prompts)
    before = on.stats.num_preemptions
    got = ids(on.generate(prompts, params))
    assert on.stats.num_preemptions > before, "the pool was meant to run dry"
    assert got == ids(off.generate(prompts, [greedy(off, 30)] * len(prompts)))
    assert ids(on.generate(prompts[::-1], params)) == got[::-1]        # again, evicting and reusing pages
    assert on.block_manager.num_used == 0


def test_aborting_a_request_that_shares_pages_leaves_the_other_exact(bf16_ckpt):
    on = make_engine(bf16_ckpt, enable_prefix_caching=True)
    off = make_engine(bf16_ckpt, enable_prefix_caching=False)
    p1, p2 = SYSTEM + [1, 2, 3], SYSTEM + [4, 5, 6]
    on.generate([SYSTEM + [9]], greedy(on, 1))       # caches the system prompt's pages
    on.add_request("a", p1, greedy(on, 30))
    on.add_request("b", p2, greedy(on, 30))
    out_a: list[int] = []
    for step in range(40):
        for o in on.step():
            if o.request_id == "a":
                out_a += o.new_token_ids
        if step == 3:
            assert on.abort("b") is not None          # shares the cached pages with "a"
        if not on.has_unfinished():
            break
    assert out_a == ids(off.generate([p1], greedy(off, 30)))[0]
    assert on.block_manager.num_used == 0


def test_each_output_reports_the_prompt_tokens_the_cache_served(bf16_ckpt):
    from helpers import make_engine
    eng = make_engine(bf16_ckpt, enable_prefix_caching=True)
    ids = eng.tokenizer.encode("A prompt long enough to fill some pages of sixteen tokens each. " * 3)
    params = eng.make_params({"temperature": 0, "max_tokens": 2, "ignore_eos": True})

    def cached():
        eng.add_request("c", ids, params)
        seen = set()
        while eng.has_unfinished():
            seen |= {o.num_cached_tokens for o in eng.step() if o.request_id == "c"}
        return seen

    assert cached() == {0}
    assert (len(ids) - 1) % 16   # a partial last page: taken by copy, all but the last token served
    assert cached() == {len(ids) - 1}
