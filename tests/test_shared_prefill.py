"""Requests of one prompt that arrive together (n > 1 choices, concurrent clients) share one prefill: the
later ones wait for the running prefill's pages and take them from the prefix cache; every request's
tokens are those it gets alone and cold."""
from __future__ import annotations

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
    full = (len(ids) - 1) // 16 * 16
    assert eng.scheduler.prefix_hits == 3 * full, "the copies did not take the first prefill's pages"
    assert res[4]["output_ids"] == cold.generate([other], _params(cold, 1))[0]["output_ids"]
    assert eng.block_manager.num_used == 0
