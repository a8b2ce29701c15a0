"""The one sampling pipeline (sampling/sampler.py) in its accelerator form (`sync_free`: nothing read on the host
until one copy of the results), run on CPU tensors: the host form's bits (and the frozen host sampler's,
tests/sampler_reference.py) for greedy and seeded rows with every filter, penalty, token mask, grammar mask and
logprobs; a row's ids do not depend on its batch; a broken row fails alone; multi-position rows (speculative
verification) give, position by position, what successive single-position steps give."""
from __future__ import annotations

import torch

from backend_lib.contract.errors import RequestError
from backend_lib.sampling import SampleError, Sampler
from backend_lib.sampling.metadata import SamplingMetadata
from backend_lib.sampling.sampler import Sample
from sampler_reference import ReferenceSampler
from helpers import EXTREMES
from sampling_helpers import KINDS, MASK_KINDS, V, FakeGrammar, FakeSeq, HistoryGrammar, P, assert_same, seqs_for


def _three_ways(logits, make):
    """The sync-free form's results, asserted equal to the frozen host sampler's and the host form's."""
    ref = ReferenceSampler()(logits, make())
    assert_same(ref, Sampler()(logits, make()))
    dev = Sampler()(logits, make(), sync_free=True)
    assert_same(ref, dev)
    return dev


def _with_bad_words(step, kinds):
    seqs = seqs_for(step, kinds)
    for s in seqs:
        if s.params.bad_words:
            s.params.bad_words_ids = [[5 + step, 8], [11], [4, 4, 5 + step, 2]]
    return seqs


def test_the_pipeline_gives_the_host_samplers_bits_for_every_kind_of_row():
    """bf16-rounded logits (many ties, as a bf16 model's): ids, logprobs, ranks and top-N bit for bit."""
    kinds = KINDS + MASK_KINDS
    for step in range(25):
        logits = (torch.randn(len(kinds), V, generator=torch.Generator().manual_seed(step)) * 3).bfloat16().float()
        _three_ways(logits, lambda: _with_bad_words(step, kinds))


def test_a_full_vocabulary_gives_the_host_samplers_bits():
    vocab = 151936
    kinds = [dict(temperature=0.6, top_p=0.95, top_k=20), dict(temperature=0.8, top_p=0.9), dict(temperature=0.7),
             dict(temperature=0, logprobs=5), dict(temperature=1.0, min_p=0.1, logprobs=2)]
    for step in range(3):
        logits = (torch.randn(len(kinds), vocab, generator=torch.Generator().manual_seed(step)) * 4).bfloat16().float()
        make = lambda: [FakeSeq(P(vocab, **k), prompt=[1, 2], output=[3], seed=10 * step + i)  # noqa: E731
                        for i, k in enumerate(kinds)]
        _three_ways(logits, make)


def test_grammar_masks_and_a_failing_grammar_fail_that_row_alone():
    def grammar(i):
        if i == 2:
            return FakeGrammar([], fail=RequestError("structured_outputs.json: the grammar failed (boom)"))
        if i == 3:
            return FakeGrammar([0, 7])          # both blocked by min_tokens: no token is allowed
        return FakeGrammar(range(i, V, 3 + i)) if i % 2 else None
    kinds = [dict(temperature=0), dict(temperature=0.7, top_p=0.9), dict(temperature=0),
             dict(temperature=0, min_tokens=9), dict(temperature=1.0, repetition_penalty=1.2), dict(temperature=0)]
    for step in range(10):
        logits = torch.randn(len(kinds), V, generator=torch.Generator().manual_seed(step))
        dev = _three_ways(logits, lambda: seqs_for(step, kinds, grammar))
        assert isinstance(dev[2], SampleError) and "boom" in dev[2].message
        assert isinstance(dev[3], SampleError) and "no token is allowed" in dev[3].message
        assert (dev[1].token_id - 1) % 4 == 0 and (dev[5].token_id - 5) % 8 == 0
        assert all(isinstance(x, Sample) for i, x in enumerate(dev) if i not in (2, 3))


def test_a_seeded_row_gives_the_same_tokens_alone_and_in_any_batch():
    """Over 12 steps, a seeded top-p row's tokens alone equal its tokens among other rows, at any position."""
    mine = dict(temperature=0.9, top_p=0.95, top_k=40, repetition_penalty=1.1, logprobs=2)
    others = [dict(temperature=1.5), dict(temperature=0), dict(min_p=0.2, logprobs=5), dict(top_k=40, temperature=2.0)]
    for sync_free in (False, True):
        runs = []
        for batch in ([mine], [mine] + others, others[:2] + [mine] + others[2:]):
            seqs = [FakeSeq(P(**k), prompt=[3, 9], seed=77 if k is mine else 5 + i) for i, k in enumerate(batch)]
            me = next(s for s in seqs if s.params.top_p == 0.95)
            sampler, toks = Sampler(), []
            for step in range(12):
                g = torch.Generator().manual_seed(1000 + step)
                mine_row = torch.randn(V, generator=g)
                logits = torch.randn(len(seqs), V, generator=torch.Generator().manual_seed(step + len(seqs)))
                logits[seqs.index(me)] = mine_row
                out = sampler(logits, seqs, sync_free=sync_free)
                for s, o in zip(seqs, out):
                    s.output_ids.append(o.token_id)
                toks.append(out[seqs.index(me)].token_id)
            runs.append(toks)
        assert runs[0] == runs[1] == runs[2]


def test_a_non_finite_row_fails_alone_with_the_host_samplers_message():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    logits[1, 17] = float("nan")
    logits[2, 5] = float("inf")
    kinds = [dict(temperature=0), dict(temperature=0), dict(temperature=0.5, top_p=0.5), dict(temperature=0.8)]
    dev = _three_ways(logits, lambda: seqs_for(0, kinds))
    assert isinstance(dev[1], SampleError) and "non-finite logit (nan)" in dev[1].message
    assert isinstance(dev[2], SampleError) and "(inf)" in dev[2].message
    assert dev[0].token_id == int(logits[0].argmax())


def test_a_failing_batched_op_samples_each_row_alone(monkeypatch):
    """A batched op that raises (here the top-k of a 3-row group) costs no row its token: each row is sampled
    again alone, with the draws it already had; a row that still fails alone fails with the op's error."""
    from backend_lib.sampling import sampler as sampler_module

    real = torch.topk

    def topk(x, k, *a, **kw):
        if x.dim() == 2 and x.shape[0] > 1 or k == 7:
            raise RuntimeError("no kernel")
        return real(x, k, *a, **kw)
    monkeypatch.setattr(sampler_module.torch, "topk", topk)
    kinds = [dict(temperature=0.9, top_k=20), dict(temperature=0), dict(temperature=0.7, top_k=20),
             dict(temperature=1.1, top_k=20), dict(temperature=0.8, top_k=7)]
    logits = torch.randn(len(kinds), V, generator=torch.Generator().manual_seed(1))
    monkeypatch.undo()
    ref = ReferenceSampler()(logits, seqs_for(0, kinds))
    monkeypatch.setattr(sampler_module.torch, "topk", topk)
    for sync_free in (False, True):
        got = Sampler()(logits, seqs_for(0, kinds), sync_free=sync_free)
        assert_same(ref[:4], got[:4])
        assert got[4] == SampleError("sampling failed (no kernel)")


def test_only_the_results_travel_back_from_the_device():
    """sync_free: the pipeline's per-row inputs are metadata (one uniform per sampled row); one tensor of B rows
    comes back (tests/test_no_host_sync.py counts the copies on fake CUDA tensors)."""
    seqs = seqs_for(0)
    meta = Sampler().metadata(seqs, V)
    greedy = [r for r in meta.rows if r.greedy]
    assert all(r.uniform == 0.0 for r in greedy)
    assert all(0.0 < r.uniform < 1.0 for r in meta.rows if not r.greedy)
    assert meta.mask is None and [list(r) for r in meta.seq_rows] == [[i] for i in range(len(seqs))]


def test_multi_position_rows_give_what_successive_single_steps_give():
    """Speculative verification's rows: sequence i with drafts d scores len(d) + 1 positions in one call; position p
    samples what the plain step after accepting d[:p] samples (penalties, bad words, min_tokens and the grammar at
    that position, the p-th draw of its generator), in any batch, in both forms."""
    kinds = [dict(temperature=0.8, top_p=0.9, repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=0.3,
                  logprobs=2), dict(temperature=0, min_tokens=4, bad_words=["x"]), dict(temperature=0.7, top_k=30),
             dict(temperature=1.0, min_p=0.05)]
    drafts = [[11, 12, 11], [], [4, 9], [13]]
    grammars = [None, None, HistoryGrammar, None]

    def make():
        seqs = _with_bad_words(0, kinds)
        for s, g in zip(seqs, grammars):
            s.grammar = g() if g else None
        return seqs
    R = sum(len(d) + 1 for d in drafts)
    logits = (torch.randn(R, V, generator=torch.Generator().manual_seed(5)) * 3).bfloat16().float()
    for sync_free in (False, True):
        seqs = make()
        multi = Sampler()(logits, seqs, drafts=drafts, sync_free=sync_free)
        single = make()
        expected, r = [], 0
        for i, d in enumerate(drafts):
            s = single[i]
            for p in range(len(d) + 1):       # successive steps of sequence i alone, its drafts accepted
                expected.extend(ReferenceSampler()(logits[r:r + 1], [s]))
                r += 1
                if p < len(d):
                    s.output_ids.append(d[p])
                    if s.grammar is not None:
                        s.grammar.accept(d[p])
        assert_same(expected, multi)
        for s, t in zip(seqs, single):          # every position drew: the generators agree
            assert torch.equal(s.generator.get_state(), t.generator.get_state())
            assert s.grammar is None or s.grammar.history == []     # the grammar left as it was


def test_rewind_draws_gives_back_the_draws_of_rejected_positions():
    seqs = [FakeSeq(P(temperature=0.9), seed=3), FakeSeq(P(temperature=0), seed=4), FakeSeq(P(top_p=0.5), seed=5)]
    meta = SamplingMetadata.build(seqs, V, [[1, 2, 3], [5], [6, 7]])
    meta.rewind_draws(seqs, [2, 1, 0])
    for s, used in zip(seqs, [2, 0, 0]):     # greedy rows draw nothing
        g = torch.Generator().manual_seed(s.generator.initial_seed())
        for _ in range(used):
            torch.rand(1, generator=g, dtype=torch.float64)
        assert torch.equal(s.generator.get_state(), g.get_state())


def test_the_engine_gives_the_same_outputs_in_either_form(bf16_engine, monkeypatch):
    """ModelRunner.execute through the sync-free form (the CUDA one, forced here on the CPU): a mixed batch of
    seeded sampled, greedy, penalised and logprobs requests gets the host form's tokens and logprobs."""
    eng = bf16_engine
    prompts = [[9707, 11, 1879, 0], [785, 3974, 13876], [13, 9707, 11], [1879, 0, 785, 3974]]
    fields = [{"temperature": 0.8, "top_p": 0.9, "seed": 1}, {"temperature": 0},
              {"temperature": 1.2, "top_k": 30, "min_p": 0.02, "repetition_penalty": 1.3, "seed": 2, "logprobs": 2},
              {"temperature": 0, "presence_penalty": 1.0, "frequency_penalty": 0.5, "logprobs": 0, "min_tokens": 3}]
    params = lambda: [eng.make_params({"max_tokens": 8, "ignore_eos": True, **f}) for f in fields]  # noqa: E731
    host = eng.generate(prompts, params())
    sampler = eng.runner.sampler
    monkeypatch.setattr(eng.runner, "sampler", lambda logits, seqs: sampler(logits, seqs, sync_free=True))
    dev = eng.generate(prompts, params())
    assert [r["output_ids"] for r in dev] == [r["output_ids"] for r in host]
    assert all(r["error"] is None for r in dev)


def test_numerically_extreme_parameters_give_the_host_samplers_bits():
    """helpers.EXTREMES (overflowing temperatures and penalties, vanishing top_p, min_p 1), test_isolation's."""
    kinds = [{k: v for k, v in e.items() if k not in ("max_tokens", "seed")} for e in EXTREMES]
    for step in range(8):
        logits = torch.randn(len(kinds), V, generator=torch.Generator().manual_seed(50 + step)) * 4
        dev = _three_ways(logits, lambda: seqs_for(step, kinds))
        assert all(isinstance(x, Sample) for x in dev)
