"""The batched device sampler (sampling/device_sampler.py), run on CPU tensors (the same device-agnostic torch code
the runner uses on CUDA): the host sampler's exact ids for greedy and seeded rows with every filter, penalty,
grammar mask and logprobs; a row's ids do not depend on its batch; a broken row fails alone."""
from __future__ import annotations

import torch

from backend_lib.contract.errors import RequestError
from backend_lib.contract.fields import SamplingLimits
from backend_lib.sampling import SampleError, Sampler, SamplingParams
from backend_lib.sampling import device_sampler
from backend_lib.sampling.device_sampler import DeviceSampler
from helpers import EXTREMES

V = 300
KINDS = [dict(temperature=0), dict(temperature=0.8), dict(temperature=1.3, top_k=20), dict(top_p=0.9),
         dict(min_p=0.05), dict(top_k=50, top_p=0.8, min_p=0.01, temperature=0.7),
         dict(temperature=0.9, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
         dict(temperature=0, repetition_penalty=1.5, min_tokens=5), dict(temperature=0.6, logprobs=3),
         dict(temperature=0, logprobs=0), dict(temperature=0, presence_penalty=-2, frequency_penalty=2),
         dict(temperature=2.0, top_k=1), dict(temperature=1e4), dict(top_p=1e-9)]


class FakeSeq:
    def __init__(self, params, prompt=(), output=(), seed=0, grammar=None):
        self.params, self.prompt_ids, self.output_ids = params, list(prompt), list(output)
        self.min_tokens_blocked_ids = [0, 7]
        self.generator = torch.Generator().manual_seed(seed)
        self.grammar = grammar


class FakeGrammar:
    """Allows the ids in `allowed` (a bitmask row, as llguidance fills it); `fail` raises while filling."""
    active = True

    def __init__(self, allowed, fail=None):
        self.allowed, self.fail = list(allowed), fail

    def fill_mask(self, out):
        if self.fail:
            raise self.fail
        bits = torch.zeros(out.numel() * 32, dtype=torch.bool)
        bits[self.allowed] = True
        words = (bits.view(-1, 32).long() << torch.arange(32)).sum(-1)
        out.copy_(torch.where(words >= 2**31, words - 2**32, words).to(torch.int32))


def P(**kw):
    return SamplingParams(**kw).validate(SamplingLimits(), V)


def _seqs(step, kinds=KINDS, grammar=lambda i: None):
    return [FakeSeq(P(**k), prompt=[1, 2, 3, step], output=[4, 4, 5 + step], seed=100 * step + i, grammar=grammar(i))
            for i, k in enumerate(kinds)]


def _same(host, dev):
    for h, d in zip(host, dev):
        assert type(h) is type(d)
        if isinstance(h, SampleError):
            assert h.message == d.message
            continue
        assert h.token_id == d.token_id
        assert (h.logprob is None) == (d.logprob is None)
        if h.logprob is not None:
            assert abs(h.logprob - d.logprob) < 1e-5
            assert [i for i, _ in h.top_logprobs] == [i for i, _ in d.top_logprobs]
            assert all(abs(a - b) < 1e-5 for (_, a), (_, b) in zip(h.top_logprobs, d.top_logprobs))


def test_the_device_pass_gives_the_host_samplers_ids_for_every_kind_of_row():
    for step in range(25):
        logits = torch.randn(len(KINDS), V, generator=torch.Generator().manual_seed(step)) * 3
        _same(Sampler()(logits, _seqs(step)), DeviceSampler()(logits, _seqs(step)))


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
        host = Sampler()(logits, _seqs(step, kinds, grammar))
        dev = DeviceSampler()(logits, _seqs(step, kinds, grammar))
        _same(host, dev)
        assert isinstance(dev[2], SampleError) and "boom" in dev[2].message
        assert isinstance(dev[3], SampleError) and "no token is allowed" in dev[3].message
        assert (dev[1].token_id - 1) % 4 == 0 and (dev[5].token_id - 5) % 8 == 0
        assert all(isinstance(x, device_sampler.Sample) for i, x in enumerate(dev) if i not in (2, 3))


def test_a_seeded_row_gives_the_same_tokens_alone_and_in_any_batch():
    """Over 12 steps, a seeded top-p row's tokens alone equal its tokens among other rows, at any position."""
    mine = dict(temperature=0.9, top_p=0.95, top_k=40, repetition_penalty=1.1, logprobs=2)
    others = [dict(temperature=1.5), dict(temperature=0), dict(min_p=0.2, logprobs=5)]
    runs = []
    for batch in ([mine], [mine] + others, others[:2] + [mine] + others[2:]):
        seqs = [FakeSeq(P(**k), prompt=[3, 9], seed=77 if k is mine else 5 + i) for i, k in enumerate(batch)]
        me = next(s for s in seqs if s.params.top_p == 0.95)
        sampler, toks = DeviceSampler(), []
        for step in range(12):
            g = torch.Generator().manual_seed(1000 + step)
            mine_row = torch.randn(V, generator=g)
            logits = torch.randn(len(seqs), V, generator=torch.Generator().manual_seed(step + len(seqs)))
            logits[seqs.index(me)] = mine_row
            out = sampler(logits, seqs)
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
    host, dev = Sampler()(logits, _seqs(0, kinds)), DeviceSampler()(logits, _seqs(0, kinds))
    _same(host, dev)
    assert isinstance(dev[1], SampleError) and "non-finite logit (nan)" in dev[1].message
    assert isinstance(dev[2], SampleError) and "(inf)" in dev[2].message
    assert dev[0].token_id == int(logits[0].argmax())


def test_a_failing_device_pass_falls_back_to_the_host_sampler(monkeypatch):
    def boom(*a):
        raise RuntimeError("no kernel")
    monkeypatch.setattr(device_sampler, "sample_batch", boom)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    kinds = KINDS[:3]
    _same(Sampler()(logits, _seqs(0, kinds)), DeviceSampler()(logits, _seqs(0, kinds)))


def test_rows_it_cannot_sample_yet_go_to_the_host():
    class Params:   # a SamplingParams with a later per-row feature (logit_bias: on the clients branch)
        def __init__(self, p):
            vars(self).update(vars(p))
            self.logit_bias = {3: 5.0}

        greedy = property(lambda self: self.temperature < 1e-5)
    seqs = _seqs(0, KINDS[:2])
    assert DeviceSampler.can_sample(seqs)
    seqs[1].params = Params(seqs[1].params)
    assert not DeviceSampler.can_sample(seqs) and not DeviceSampler.can_sample([])


def test_only_the_step_inputs_travel_one_way_and_one_tensor_comes_back():
    """Per row: a handful of parameters and one uniform; the result: B rows of TOP + 2N float64."""
    seqs = _seqs(0)
    rows, _ = DeviceSampler().rows(seqs, V)
    assert rows.uniform.shape == (len(seqs),) and rows.mask is None and rows.top_n == 3
    packed = DeviceSampler.on_device(torch.randn(len(seqs), V), rows)
    assert packed.shape == (len(seqs), device_sampler.TOP + 6) and packed.dtype == torch.float64
    greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
    assert rows.uniform[greedy].eq(0).all() and rows.uniform.ne(0).sum() == len(seqs) - len(greedy)


def test_the_engine_with_the_device_sampler_gives_the_host_samplers_outputs(bf16_engine):
    """ModelRunner.execute through DeviceSampler (the CUDA choice, forced here on the CPU): a mixed batch of seeded
    sampled, greedy, penalised and logprobs requests gets the host sampler's tokens and logprobs."""
    eng = bf16_engine
    prompts = [[9707, 11, 1879, 0], [785, 3974, 13876], [13, 9707, 11], [1879, 0, 785, 3974]]
    fields = [{"temperature": 0.8, "top_p": 0.9, "seed": 1}, {"temperature": 0},
              {"temperature": 1.2, "top_k": 30, "min_p": 0.02, "repetition_penalty": 1.3, "seed": 2, "logprobs": 2},
              {"temperature": 0, "presence_penalty": 1.0, "frequency_penalty": 0.5, "logprobs": 0, "min_tokens": 3}]
    params = [eng.make_params({"max_tokens": 8, "ignore_eos": True, **f}) for f in fields]
    host = eng.generate(prompts, params)
    assert eng.runner.device_sampler is None                      # the CPU samples on the host
    eng.runner.device_sampler = DeviceSampler(eng.runner.sampler)
    try:
        dev = eng.generate(prompts, [eng.make_params({"max_tokens": 8, "ignore_eos": True, **f}) for f in fields])
    finally:
        eng.runner.device_sampler = None
    assert [r["output_ids"] for r in dev] == [r["output_ids"] for r in host]
    assert all(r["error"] is None for r in dev)


def test_numerically_extreme_parameters_give_the_host_samplers_ids():
    """helpers.EXTREMES (overflowing temperatures and penalties, vanishing top_p, min_p 1), test_isolation's."""
    kinds = [{k: v for k, v in e.items() if k not in ("max_tokens", "seed")} for e in EXTREMES]
    for step in range(8):
        logits = torch.randn(len(kinds), V, generator=torch.Generator().manual_seed(50 + step)) * 4
        host, dev = Sampler()(logits, _seqs(step, kinds)), DeviceSampler()(logits, _seqs(step, kinds))
        _same(host, dev)
        assert all(isinstance(x, device_sampler.Sample) for x in dev)
