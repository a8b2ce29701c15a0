"""Priority scheduling (vLLM's): with scheduling_policy priority, lower `priority` values are admitted first
and, when pages run out, preempt lower-priority running requests; every request still gets exactly the
tokens it gets alone. With fcfs (the default) a priority is an error naming it."""
from __future__ import annotations

import pytest

from backend_lib.contract.errors import RequestError
from helpers import make_engine

PROMPTS = ["Hello, world!", "The quick brown fox", "Once upon a time", "def fib(n):"]


def _params(eng, priority=0, n=30):
    return eng.make_params({"temperature": 0, "max_tokens": n, "ignore_eos": True, "priority": priority})


def _run(eng, items):
    """(prompt ids, params) requests added at once; returns their ids and the order they finished in."""
    got, order = {}, []
    for i, (ids, p) in enumerate(items):
        eng.add_request(f"r{i}", ids, p)
        got[f"r{i}"] = []
    while eng.has_unfinished():
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
            if out.finished:
                order.append(int(out.request_id[1:]))
    return [got[f"r{i}"] for i in range(len(items))], order


def test_lower_priority_values_are_served_first(bf16_ckpt):
    eng = make_engine(bf16_ckpt, scheduling_policy="priority", max_num_seqs=1)
    ids = [eng.tokenizer.encode(p) for p in PROMPTS]
    solo = [eng.generate([i], _params(eng, n=8))[0]["output_ids"] for i in ids]
    outs, order = _run(eng, [(ids[0], _params(eng, 5, 8)), (ids[1], _params(eng, -1, 8)),
                             (ids[2], _params(eng, 5, 8)), (ids[3], _params(eng, 0, 8))])
    assert order == [1, 3, 0, 2]   # by priority, then arrival
    assert outs == solo


def _late_arrival(bf16_ckpt, policy):
    """6 pages of 16 tokens: two requests of 20 + 24 tokens (3 pages each at their end) hold 4 pages at step 10,
    when a short request of a 40-token prompt (3 pages) arrives: it fits only if one of them gives way."""
    eng = make_engine(bf16_ckpt, scheduling_policy=policy, kv_cache_memory=6 * 16 * 1024, max_model_len=64,
                      max_num_seqs=4, enable_prefix_caching=False)
    prio = policy == "priority"
    ids = [eng.tokenizer.encode(p * 16)[:n] for p, n in zip(PROMPTS[:3], (20, 20, 40))]
    assert [len(i) for i in ids] == [20, 20, 40]
    lengths = (24, 24, 4)
    solo = [eng.generate([i], _params(eng, n=n))[0]["output_ids"] for i, n in zip(ids, lengths)]
    for i in range(2):
        eng.add_request(f"low{i}", ids[i], _params(eng, 10 if prio else 0, 24))
    got = {"low0": [], "low1": [], "high": []}
    order = []
    for step in range(500):
        if step == 10:
            before = eng.scheduler.num_preemptions
            eng.add_request("high", ids[2], _params(eng, -5 if prio else 0, 4))
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
            if out.finished:
                order.append(out.request_id)
        if step == 10:
            preempted_at_arrival = eng.scheduler.num_preemptions > before
        if not eng.has_unfinished():
            break
    assert [got["low0"], got["low1"], got["high"]] == solo   # exact, preempted or not
    assert eng.block_manager.num_used == 0
    return order, preempted_at_arrival


def test_a_high_priority_request_preempts_lower_ones_when_pages_run_out(bf16_ckpt):
    order, preempted = _late_arrival(bf16_ckpt, "priority")
    assert preempted and order[0] == "high", order
    order, preempted = _late_arrival(bf16_ckpt, "fcfs")
    assert not preempted and order[0] != "high", order   # fcfs: it waits for pages


def test_fcfs_refuses_a_priority_and_the_policy_is_checked(bf16_engine, bf16_ckpt):
    with pytest.raises(RequestError, match="priority"):
        bf16_engine.make_request("p", [1, 2], bf16_engine.make_params({"priority": 3}))
    bf16_engine.make_request("p", [1, 2], bf16_engine.make_params({"priority": 0}))
    with pytest.raises(RequestError, match="priority"):
        bf16_engine.make_params({"priority": 2**40})
    with pytest.raises(ValueError, match="scheduling_policy"):
        make_engine(bf16_ckpt, scheduling_policy="lifo")


def test_a_flood_of_higher_priority_requests_delays_a_low_one_but_never_starves_it(bf16_ckpt):
    """Aging: a priority-1 request behind a flood of priority-0 ones (two new ones every step, one slot, so the flood
    never ends by itself) is overtaken by at most PRIORITY_AGING of them, then runs with its solo tokens; a
    client's priority of -2**31 ages as -PRIORITY_SPAN (the bound holds for any value)."""
    from backend_lib.engine.scheduler import PRIORITY_AGING, PRIORITY_SPAN, Scheduler

    eng = make_engine(bf16_ckpt, scheduling_policy="priority", max_num_seqs=1)
    ids = eng.tokenizer.encode(PROMPTS[0])
    solo = eng.generate([ids], _params(eng, n=2))[0]["output_ids"]
    eng.add_request("low", ids, _params(eng, 1, 2))
    overtaken, low_out, added = 0, [], 0
    for _ in range(4 * PRIORITY_AGING):   # bounded: the low one must be done well before
        for _ in range(2):
            eng.add_request(f"f{added}", ids, _params(eng, 0, 2))
            added += 1
        for out in eng.step():
            if out.request_id == "low":
                low_out += out.new_token_ids
            elif out.finished and not low_out:
                overtaken += 1
        if len(low_out) == 2:
            break
    assert low_out == solo, (overtaken, added)
    assert PRIORITY_AGING // 2 <= overtaken <= PRIORITY_AGING, overtaken   # it waited, and not forever
    while eng.has_unfinished():
        eng.step()

    class Seq:
        def __init__(self, priority, arrival):
            self.params, self.arrival = type("P", (), {"priority": priority})(), arrival

    rank = Scheduler._rank
    victim = Seq(0, 0)
    assert rank(Seq(-2**31, PRIORITY_AGING * PRIORITY_SPAN - 1)) < rank(victim) < \
        rank(Seq(-2**31, PRIORITY_AGING * PRIORITY_SPAN + 1))
    assert rank(Seq(-2**31, 5)) < rank(Seq(-2**30, 5))   # among equally aged, the priority still orders
