"""[spec] The batch gate (backend_lib/spec/gate.py, speculative_config.auto_disable_from_batch): per batch size,
drafting only while it is measured to give more tokens per second than plain steps; the ids never depend on it."""
from __future__ import annotations

import json

import pytest

from backend_lib.spec import parse_speculative_config
from backend_lib.spec.gate import PLAIN, SPEC, BatchGate
from helpers import make_engine
from spec_helpers import GREEDY, PROMPTS, spec_ids

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def _run(gate, n, steps, rate):
    """`steps` steps of n decoding sequences; rate(arm) -> (tokens, seconds) of a step of that arm."""
    arms = []
    for _ in range(steps):
        arm = gate.choose(n)
        arms.append(arm)
        gate.record(n, arm, *rate(arm))
    return arms


def test_below_its_batch_the_gate_always_drafts():
    gate = BatchGate(4, warmup=2, probe=1, explore=4)
    assert _run(gate, 3, 50, lambda arm: (1, 1.0) if arm == SPEC else (100, 0.01)) == [SPEC] * 50
    assert gate.gated_steps == 0


def test_the_gate_measures_both_arms_then_keeps_the_faster_and_explores_the_other():
    gate = BatchGate(4, warmup=8, probe=3, explore=5)
    slow_spec = lambda arm: (20, 0.1) if arm == SPEC else (16, 0.05)   # noqa: E731 (200 vs 320 tokens/s)
    arms = _run(gate, 16, 60, slow_spec)
    assert arms[:8] == [SPEC] * 8 and arms[8:11] == [PLAIN] * 3          # warm-up drafts, then the probe
    rest = arms[11:]
    assert rest.count(SPEC) == len([i for i in range(12, 61) if i % 5 == 0]) > 0   # only the explore steps draft
    assert gate.gated_steps == arms.count(PLAIN)
    # another bucket (8..15 sequences) is measured on its own: it starts by drafting
    assert _run(gate, 8, 3, slow_spec) == [SPEC] * 3
    # where drafting pays, it stays on (the plain arm only on its explore steps)
    fast = BatchGate(4, warmup=8, probe=3, explore=5)
    arms = _run(fast, 4, 60, lambda arm: (10, 0.02) if arm == SPEC else (4, 0.02))
    assert arms[11:].count(PLAIN) == len([i for i in range(12, 61) if i % 5 == 0])


def test_a_change_of_workload_moves_the_choice():
    gate = BatchGate(4, warmup=4, probe=2, explore=4)
    _run(gate, 16, 40, lambda arm: (40, 0.1) if arm == SPEC else (16, 0.1))      # drafting pays
    assert [gate.choose(16) for _ in range(8)].count(SPEC) >= 6
    _run(gate, 16, 200, lambda arm: (17, 0.2) if arm == SPEC else (16, 0.1))     # now it does not
    picks = [gate.choose(16) for _ in range(8)]
    assert picks.count(PLAIN) >= 6


def test_the_key_is_validated_naming_it():
    assert parse_speculative_config(NGRAM).auto_disable_from_batch == 4                       # the default
    assert parse_speculative_config({**NGRAM, "auto_disable_from_batch": None}).auto_disable_from_batch is None
    assert parse_speculative_config({**NGRAM, "auto_disable_from_batch": 8}).auto_disable_from_batch == 8
    for bad in (0, -1, "4", 2.5, True):
        with pytest.raises(ValueError, match="speculative_config.auto_disable_from_batch"):
            parse_speculative_config({**NGRAM, "auto_disable_from_batch": bad})


def test_an_engine_whose_gate_finds_plain_steps_faster_keeps_the_ids_and_drafts_only_to_explore(bf16_ckpt):
    """The gate's measurements forced (drafting steps reported 100x slower): past its warm-up and probe the
    batch's steps draft only on explore steps, a lone request (below the gate's batch) drafts every step; the ids
    are the engine's without speculation throughout."""
    off = make_engine(bf16_ckpt)
    on = make_engine(bf16_ckpt, speculative_config=json.dumps({**NGRAM, "auto_disable_from_batch": 2}))
    gate = on.spec.gate
    gate.warmup, gate.probe, gate.explore = 3, 2, 6
    real = gate.record
    seen = []

    def record(n, arm, tokens, seconds):
        seen.append((n, arm))
        real(n, arm, tokens, seconds * (100.0 if arm == SPEC else 1.0))
    gate.record = record
    prompts = [on.tokenizer.encode(p) for p in PROMPTS]
    params = {**GREEDY, "max_tokens": 40}
    assert spec_ids(on, prompts, params) == spec_ids(off, prompts, params)
    batched = [arm for n, arm in seen if n >= 2]
    assert batched.count(PLAIN) >= 10 and gate.gated_steps == sum(1 for n, a in seen if a == PLAIN) > 0
    assert on.stats.spec_gated_steps == gate.gated_steps
    assert all(a == SPEC for n, a in seen if n < 2)
    drafts = on.stats.spec_num_drafts
    assert spec_ids(on, prompts[1:2], params) == spec_ids(off, prompts[1:2], params)   # alone: drafts again
    assert on.stats.spec_num_drafts > drafts
