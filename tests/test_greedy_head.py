"""greedy_head: int8 (layers/greedy_head.py): plain-greedy rows picked through an int8 screen of the float head with a
certified bound, then the candidates' exact logits. The token must be the whole product's argmax (its first maximum)
on every row; float_linear_rows must give the whole product's bits."""
from __future__ import annotations

import pytest
import torch

from helpers import make_engine

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def cpu():
    from backend_lib.kernels import cpu as cpu_set

    k = cpu_set.load()
    if k is None:
        pytest.skip("no C++ compiler")
    return k


@pytest.mark.parametrize("wdt", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(1000, 64), (4099, 256), (300, 34)])
def test_float_linear_rows_are_the_whole_products_columns(cpu, wdt, n, k):
    torch.manual_seed(n + k)
    w = torch.randn(n, k).to(wdt)
    p = cpu.float_prepare(w)
    for m in (1, 2, 7):
        for xdt in (torch.bfloat16, torch.float32):
            x = torch.randn(m, k).to(xdt)
            full = cpu.float_linear(x, p, torch.float32)
            ids = torch.cat([torch.tensor([0, n - 1]), torch.randperm(n)[:130]]).sort().values
            got = cpu.linear_rows(x, p, ids)
            assert got.dtype == torch.float32 and got.shape == (m, ids.numel())
            assert torch.equal(got.view(torch.int32), full[:, ids].view(torch.int32)), (m, xdt)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu.linear_rows(x, p, torch.tensor([n]))


def test_the_contracts_default_linear_rows_indexes_the_whole_product():
    from backend_lib.kernels import REFERENCE as ref

    w = torch.randn(200, 32)
    p = ref.float_prepare(w)
    x = torch.randn(3, 32)
    ids = torch.tensor([1, 5, 199])
    assert torch.equal(ref.linear_rows(x, p, ids), ref.float_linear(x, p, torch.float32)[:, ids])


def _head(cpu, w):
    from backend_lib.layers.greedy_head import ScreenedHead

    return ScreenedHead(w, cpu)


def _composed(cpu):
    """The CPU set without its one-call pick (Kernels.greedy_head_picks): greedy_picks composes the slots' steps."""
    import dataclasses

    return dataclasses.replace(cpu, greedy_head_picks=None)


def _argmax(head, x):
    return head(x, torch.float32).argmax(dim=-1).tolist()


def test_the_bound_holds_and_the_picks_are_the_argmax(cpu):
    """|Y - A| <= B on every logit of random and outlier-heavy rows, few candidates, and the picks equal the whole
    product's argmax, alone and batched."""
    torch.manual_seed(0)
    n, k = 20000, 256
    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    head = _head(cpu, w)
    xs = torch.randn(24, k)
    xs[8:16, :4] *= 40.0                                      # activation outliers, as real hidden states have
    xs[16:] *= torch.rand(8, 1) * 1e3
    xs = xs.to(torch.bfloat16)
    # adversarial rows: x = sign(e_n) (each |x_k| = 1, so x quantizes exactly, r = 0) makes the weight's own rounding
    # error <x, e_n> = |e_n|_1 for row n, past what the activation term alone allows
    from backend_lib.layers.linear import int8_rows

    q, s = int8_rows(w)
    e = w.double() - s.double()[:, None] * q.double()
    adv = torch.sign(e[[3, 500, 19999]]).to(torch.bfloat16)
    adv[adv == 0] = 1
    xs = torch.cat([xs, adv])
    exact = head(xs, torch.float32)
    approx, bound = head.screen_bound(xs)
    assert torch.equal(approx, head.screen(xs.float()))
    assert bool(((exact - approx).abs() <= bound).all())
    rows, union = head.candidates(xs)
    for b in range(xs.shape[0]):
        assert int(exact[b].argmax()) in rows[b].tolist()
        assert rows[b].numel() < n // 20, rows[b].numel()
    composed = _head(_composed(cpu), w)
    assert head.kernels.greedy_head_picks is not None and composed.kernels.greedy_head_picks is None
    assert head.greedy_picks(xs) == composed.greedy_picks(xs) == _argmax(head, xs)
    for b in range(0, xs.shape[0], 5):
        assert head.greedy_picks(xs[b:b + 1]) == composed.greedy_picks(xs[b:b + 1]) == _argmax(head, xs[b:b + 1])
    assert head.stats["candidates"] == composed.stats["candidates"] > 0   # the same union, step by step
    assert head.stats["fallbacks"] == composed.stats["fallbacks"] == 0


def test_the_fused_screen_finds_the_torch_formulas_candidates(cpu):
    """Kernels.greedy_screen (the CPU set's one pass) against the same test in torch ops (the contract's default),
    and its refusals: a non-finite A and a row past the limit get count -1."""
    import dataclasses

    from backend_lib.layers.greedy_head import MARGIN, U, ScreenedHead

    torch.manual_seed(2)
    n, k = 30011, 128                       # N not a multiple of the vector width: the scalar tail runs
    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    fused = ScreenedHead(w, cpu)
    plain = ScreenedHead(w, dataclasses.replace(cpu, greedy_screen=None, greedy_head_picks=None))
    xs = torch.randn(9, k).to(torch.bfloat16)
    xs[3] *= 300.0
    got, want = fused.candidates(xs), plain.candidates(xs)
    assert [r.tolist() for r in got[0]] == [r.tolist() for r in want[0]]
    assert torch.equal(got[1], want[1]) and got[1].numel() < n // 10
    assert fused.greedy_picks(xs) == plain.greedy_picks(xs) == _argmax(fused, xs)
    a, terms = fused.screen_terms(xs)
    a[4, n - 1] = float("inf")
    a[6, 17] = float("nan")
    ids, counts = cpu.greedy_screen(a, fused.c, fused.d, terms, 8 * U * MARGIN, 2048)
    counts = counts.tolist()
    assert counts[4] == counts[6] == -1 and min(counts[:4]) > 0
    assert ids.numel() == sum(c for c in counts if c > 0)
    few = cpu.greedy_screen(a[:1], fused.c, fused.d, terms[:1], 8 * U * MARGIN, 1)[1].tolist()
    assert few == ([-1] if counts[0] > 1 else [1])
    # a row's candidates in more than one of the pass's chunks of N: ascending in one list, the limit over them all
    row = torch.full((1, n), -1e3)
    row[0, [5, 20000, 30000]] = 10.0
    ids, counts = cpu.greedy_screen(row, fused.c, fused.d, terms[:1], 8 * U * MARGIN, 3)
    assert ids.tolist() == [5, 20000, 30000] and counts.tolist() == [3]
    assert cpu.greedy_screen(row, fused.c, fused.d, terms[:1], 8 * U * MARGIN, 2)[1].tolist() == [-1]


@pytest.mark.parametrize("one_call", [True, False], ids=["one_call", "composed"])
def test_ties_go_to_the_lowest_index_and_degenerate_rows(cpu, one_call):
    torch.manual_seed(1)
    n, k = 5000, 64
    w = torch.randn(n, k).to(torch.bfloat16)
    v = torch.randn(k).to(torch.bfloat16) * 4
    for i in (4000, 77, 2500):                 # three equal rows, the largest logit of x = v
        w[i] = v
    head = _head(cpu if one_call else _composed(cpu), w)
    x = v[None].clone()
    assert head.greedy_picks(x) == [77] == _argmax(head, x)
    two = torch.cat([x, -x])                   # a batch: each row its own first maximum
    assert head.greedy_picks(two) == _argmax(head, two)
    zero = torch.zeros(1, k, dtype=torch.bfloat16)        # every logit 0: every row a candidate, too many
    assert head.greedy_picks(zero) is None and _argmax(head, zero) == [0]
    bad = x.clone()
    bad[0, 3] = float("nan")
    assert head.greedy_picks(bad) is None                 # the caller's whole product reports it
    inf = x.clone()
    inf[0, 0] = float("inf")
    assert head.greedy_picks(inf) is None
    assert head.stats["fallbacks"] == 3


def test_a_weight_that_is_not_finite_turns_the_screen_off(cpu):
    w = torch.randn(300, 32)
    w[7, 3] = float("inf")
    assert not _head(cpu, w).finite


def test_greedy_ids_are_the_unscreened_engines_alone_and_batched(a8w8_ckpt, bf16_ckpt):
    from backend_lib.layers.greedy_head import ScreenedHead
    from backend_lib.sampling.params import SamplingParams

    prompts = [[11, 22, 33, 44, 55], [7] * 19, list(range(100, 140)), [5, 6]]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for ckpt, dtype in ((a8w8_ckpt, "bfloat16"), (bf16_ckpt, "float32")):
        on = make_engine(ckpt, dtype=dtype)
        off = make_engine(ckpt, dtype=dtype, greedy_head="off")
        assert isinstance(on.runner.model.lm_head, ScreenedHead)
        assert not isinstance(off.runner.model.lm_head, ScreenedHead)
        want = [o["output_ids"] for o in off.generate(prompts, greedy)]
        assert [o["output_ids"] for o in on.generate(prompts, greedy)] == want
        assert [on.generate([p], greedy)[0]["output_ids"] for p in prompts] == want
        stats = on.runner.model.lm_head.stats
        assert stats["rows"] > 0 and stats["fallbacks"] == 0
        # a sampled row beside greedy ones: the step takes the whole product, the greedy rows' ids unchanged
        sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
        mixed = on.generate(prompts[:2], [greedy, sampled])
        assert mixed[0]["output_ids"] == want[0]
        assert mixed[1]["output_ids"] == off.generate(prompts[1:2], sampled)[0]["output_ids"]


def test_verification_rows_are_screened_and_the_ids_are_plain_greedys(bf16_ckpt):
    """[spec] a verifying sequence's k + 1 rows picked through the screen: the accepted runs and the ids are those
    of plain decoding with the whole head (greedy_head: off, no speculation), alone and batched."""
    import json

    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                       "prompt_lookup_min": 2, "auto_disable_from_batch": None})
    on = make_engine(bf16_ckpt, speculative_config=spec)
    off = make_engine(bf16_ckpt, greedy_head="off")
    prompts = [on.tokenizer.encode(t) for t in ("a b a b a b a b a b a b", "1, 2, 3, 1, 2, 3, 1, 2, 3", "Hello")]
    params = on.make_params({"temperature": 0, "max_tokens": 40, "ignore_eos": True})
    want = [o["output_ids"] for o in off.generate(prompts, params)]
    assert [o["output_ids"] for o in on.generate(prompts, params)] == want
    assert [on.generate([p], params)[0]["output_ids"] for p in prompts] == want
    stats, spec_stats = on.runner.model.lm_head.stats, on.stats
    assert spec_stats.spec_num_accepted_tokens > 0, "no draft accepted: no verification was screened"
    generated = 2 * sum(len(w) for w in want)
    # every step screened: a row per token of plain decode, k + 1 per verification (rejected rows too); with the
    # verifications unscreened the rows would be the tokens less the accepted runs
    assert stats["fallbacks"] == 0 and stats["rows"] >= generated


def test_greedy_head_config_is_validated():
    from backend_lib.config import EngineConfig

    assert EngineConfig.from_params({"checkpoint": "x"}).greedy_head == "auto"
    with pytest.raises(ValueError, match="greedy_head"):
        EngineConfig.from_params({"checkpoint": "x", "greedy_head": "int4"})
    with pytest.raises(ValueError, match="greedy_head.*lm_head_quant"):
        EngineConfig.from_params({"checkpoint": "x", "greedy_head": "int8", "lm_head_quant": "int8"})
    with pytest.raises(ValueError, match="greedy_head.*tensor_parallel_size"):
        EngineConfig.from_params({"checkpoint": "x", "greedy_head": "int8", "tensor_parallel_size": "2"})
