"""Requests of one prompt that arrive together (n > 1 choices, concurrent clients) share one prefill: the
later ones wait for the running prefill's pages and take them from the prefix cache, the prompt's partial
last page by copy, and compute their last token only; every request's tokens are those it gets alone and
cold."""
from __future__ import annotations

import pytest
from helpers import make_engine

TEXT = "The quick brown fox jumps over the lazy dog. " * 12


def _params(eng, seed):
    return eng.make_params({"temperature": 1.0, "seed": seed, "max_tokens": 8, "ignore_eos": True})


def test_n_copies_of_a_prompt_prefill_once_and_equal_their_cold_runs(bf16_ckpt):
    cold = make_engine(bf16_ckpt)   # no prefix cache
    ids = cold.tokenizer.encode(TEXT)
    assert len(ids) > 4 * 16
    solo = [cold.generate([ids], _params(cold, 100 + j))[0]["output_ids"] for j in range(4)]
    eng = make_engine(bf16_ckpt, enable_prefix_caching=True)
    other = eng.tokenizer.encode("Something else entirely, to share the batch")
    res = eng.generate([ids] * 4 + [other], [_params(eng, 100 + j) for j in range(4)] + [_params(eng, 1)])
    assert [r["output_ids"] for r in res[:4]] == solo
    assert (len(ids) - 1) % 16, "the prompt ends in a partial page (the case of the copy)"
    assert eng.scheduler.prefix_hits == 3 * (len(ids) - 1), \
        "the copies did not take the first prefill's pages, the partial last one included"
    assert res[4]["output_ids"] == cold.generate([other], _params(cold, 1))[0]["output_ids"]
    assert eng.block_manager.num_used == 0


@pytest.mark.parametrize("kv_cache", ["bf16", "tq"])
def test_a_later_request_of_the_same_prompt_copies_the_partial_page_and_matches_cold(bf16_ckpt, kv_cache):
    """After the first request has finished: its full pages are shared, its partial last page copied (the
    copy's source stays cached, evictable), and a decode that then writes into the copy changes nothing
    of the source: a third request still gets its cold tokens."""
    cold = make_engine(bf16_ckpt, kv_cache=kv_cache)
    ids = cold.tokenizer.encode(TEXT)
    solo = [cold.generate([ids], _params(cold, 200 + j))[0]["output_ids"] for j in range(3)]
    eng = make_engine(bf16_ckpt, kv_cache=kv_cache, enable_prefix_caching=True)
    got = [eng.generate([ids], _params(eng, 200 + j))[0]["output_ids"] for j in range(3)]
    assert got == solo
    assert eng.scheduler.prefix_hits == 2 * (len(ids) - 1)
    assert eng.block_manager.num_used == 0 and not eng.scheduler.page_copies


def test_a_preempted_request_drops_its_pending_copy():
    """A request admitted with a copy and preempted in the same schedule: the copy is cancelled and its
    source unpinned (nothing would copy into a page handed to someone else)."""
    from backend_lib.engine.scheduler import Scheduler
    from backend_lib.engine.sequence import Sequence
    from backend_lib.kv_cache.block_manager import BlockManager
    from backend_lib.sampling.params import SamplingParams

    bm = BlockManager(8, 4, enable_prefix_caching=True)
    sched = Scheduler(bm, 4, 64)
    first = Sequence("a", list(range(10)), SamplingParams(), 4, set())
    first.cache_root = b"r" * 16
    sched.add(first)
    plan = sched.schedule()
    assert plan == [(first, 10)]
    first.num_computed = 10
    sched.cache_full_pages(first)
    sched.remove(first)
    second = Sequence("b", list(range(10)), SamplingParams(), 4, set())
    second.cache_root = b"r" * 16
    sched.add(second)
    assert sched.schedule() == [(second, 1)] and len(sched.page_copies) == 1
    src = sched.page_copies[0][0]
    sched._preempt(second)
    assert not sched.page_copies and bm._ref[src] == 0


def test_the_plan_carries_the_copy_and_update_unpins_advances_and_registers():
    """schedule -> run -> update: next_step hands the page copy to the runner in the plan (its source pinned),
    update unpins it, advances the sequences and records their full pages; a failed step (None) only unpins."""
    from backend_lib.engine.scheduler import Scheduler
    from backend_lib.engine.sequence import Sequence
    from backend_lib.kv_cache.block_manager import BlockManager
    from backend_lib.sampling.params import SamplingParams

    bm = BlockManager(8, 4, enable_prefix_caching=True)
    sched = Scheduler(bm, 4, 64)
    first = Sequence("a", list(range(10)), SamplingParams(), 4, set())
    first.cache_root = b"r" * 16
    sched.add(first)
    plan = sched.next_step()
    assert plan.seqs == [(first, 10)] and plan.page_copies == []
    sched.update(plan, object())
    assert first.num_computed == 10 and first.num_registered == 2 and first.tail_registered
    sched.remove(first)
    for result in (None, object()):
        second = Sequence("b", list(range(10)), SamplingParams(), 4, set())
        second.cache_root = b"r" * 16
        sched.add(second)
        plan = sched.next_step()
        assert plan.seqs == [(second, 1)] and len(plan.page_copies) == 1 and not sched.page_copies
        src = plan.page_copies[0][0]
        assert bm._ref[src] == 1                      # pinned while the runner copies it
        sched.update(plan, result)
        assert bm._ref[src] == 0 and second.num_computed == (9 if result is None else 10)   # 9: cached + copied
        sched.remove(second)
