"""Sampling: parameter validation, filtering and penalties row by row."""
from __future__ import annotations

import pytest
import torch

from backend_lib.contract.errors import RequestError
from backend_lib.contract.fields import SamplingLimits
from backend_lib.sampling import SamplingParams, Sampler


class FakeSeq:
    def __init__(self, params, prompt=(), output=(), seed=0):
        self.params, self.prompt_ids, self.output_ids = params, list(prompt), list(output)
        self.min_tokens_blocked_ids = [0]
        self.generator = torch.Generator().manual_seed(seed)
        self.grammar = None


def P(**kw):
    return SamplingParams(**kw).validate(SamplingLimits(), 100)


def test_top_k_one_is_greedy_and_top_p_keeps_the_nucleus():
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0] + [-9.0] * 96])
    s = Sampler()
    for seed in range(20):
        assert s(logits, [FakeSeq(P(top_k=1), seed=seed)])[0].token_id == 1
        t = s(logits, [FakeSeq(P(top_p=0.6), seed=seed)])[0].token_id
        assert t in (1, 2)


def test_greedy_respects_penalties_and_min_tokens():
    logits = torch.tensor([[5.0, 4.0, 1.0] + [-9.0] * 97])
    s = Sampler()
    assert s(logits, [FakeSeq(P(temperature=0))])[0].token_id == 0
    assert s(logits, [FakeSeq(P(temperature=0, min_tokens=2), output=[3])])[0].token_id == 1  # 0 is blocked
    assert s(logits, [FakeSeq(P(temperature=0, repetition_penalty=2.0), prompt=[0])])[0].token_id == 1
    assert s(logits, [FakeSeq(P(temperature=0, presence_penalty=1.5), output=[0])])[0].token_id == 1
    assert s(logits, [FakeSeq(P(temperature=0, frequency_penalty=0.4), output=[0, 0, 0])])[0].token_id == 1


def test_sampling_distribution_follows_temperature():
    logits = torch.tensor([[1.0, 0.0] + [-30.0] * 98])
    s = Sampler()
    seq = FakeSeq(P(temperature=1.0), seed=7)
    picks = [s(logits, [seq])[0].token_id for _ in range(2000)]
    frac = picks.count(0) / len(picks)
    assert abs(frac - torch.sigmoid(torch.tensor(1.0)).item()) < 0.04


@pytest.mark.parametrize("kw, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=10**6), "max_tokens"), (dict(max_tokens=1.5), "max_tokens"),
    (dict(temperature=-0.1), "temperature"), (dict(temperature="hot"), "temperature"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(seed=-1), "seed"), (dict(stop=[1, 2]), "stop"),
    (dict(stop=["x" * 1000]), "stop"), (dict(stop_token_ids=[100]), "stop_token_ids"),
    (dict(logprobs=50), "logprobs"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(presence_penalty=5), "presence_penalty"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
])
def test_invalid_parameters_name_the_field(kw, field):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**kw).validate(SamplingLimits(), 100)


def test_unknown_keys_are_named():
    with pytest.raises(RequestError, match="'best_of'"):
        SamplingParams.from_dict({"best_of": 2})


def test_min_p_keeps_tokens_within_a_fraction_of_the_top_probability():
    logits = torch.tensor([[3.0, 2.9, 1.0, 0.0] + [-9.0] * 96])
    s = Sampler()
    picks = {s(logits, [FakeSeq(P(min_p=0.5), seed=seed)])[0].token_id for seed in range(60)}
    assert picks == {0, 1}                     # p(2) / p(0) = e^-2 < 0.5: filtered
    assert {s(logits, [FakeSeq(P(), seed=seed)])[0].token_id for seed in range(200)} > {0, 1}


def test_plain_greedy_rows_take_the_first_maximum_in_either_form():
    """A step of plain greedy rows (the host form's shortcut; off the CPU only ids leave the device) gives the
    full pipeline's tokens, ties to the first index as argmax on the host; rows that need processing or logprobs
    beside them, and non-finite logits (whose error both forms word alike), too."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 100, generator=g)
    logits[2, 7] = logits[2].max() + 1
    logits[3, [3, 9]] = logits[3].max() + 1                  # a tie: the first index, as argmax on the host
    s = Sampler()
    plain = [FakeSeq(P(temperature=0)) for _ in range(4)]
    fast = s(logits, plain)
    full = s.sample(logits, s.metadata(plain, 100))          # the pipeline without the shortcut
    dev = s(logits, plain, sync_free=True)
    assert [x.token_id for x in fast] == [x.token_id for x in full] == [x.token_id for x in dev] == \
        logits.argmax(dim=-1).tolist() and fast[3].token_id == 3
    for odd in (P(temperature=0.7), P(temperature=0, repetition_penalty=1.2), P(temperature=0, logprobs=2),
                P(temperature=0, min_tokens=3)):
        mixed = lambda: plain[:3] + [FakeSeq(odd)]  # noqa: E731
        assert [x.token_id for x in s(logits, mixed())] == [x.token_id for x in s(logits, mixed(), sync_free=True)]
    bad = logits.clone()
    bad[1, 0] = float("nan")
    for out in (s(bad, plain), s(bad, plain, sync_free=True), s.sample(bad, s.metadata(plain, 100))):
        assert out[1].message == "the model produced a non-finite logit (nan) for this request"
        assert [x.token_id for i, x in enumerate(out) if i != 1] == [fast[i].token_id for i in (0, 2, 3)]


def test_the_cpu_sets_argmax_rows_is_plain_greedy_picks_in_one_read():
    """The CPU set's argmax_rows slot (csrc/argmax.cpp) gives plain_greedy_picks' picks and non-finite rows on fp32
    and on bf16 logits as the head writes them (ties to the first index, -0.0 and 0.0 equal, each non-finite kind
    anywhere in a row), and a Sampler with it the tokens and errors of one without."""
    from backend_lib.kernels import get_kernels
    from backend_lib.sampling.sampler import plain_greedy_picks

    cpu = get_kernels("cpu", "cpu")
    if cpu is None or cpu.argmax_rows is None:
        pytest.skip("no compiled CPU kernel set here")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 151936, generator=g)
    x[1, 5] = x[1, 9] = 100.0                        # a tie: the first index wins
    x[2] = float("-inf")
    x[2, 7] = -1e30
    x[3, :100] = 3e38
    x[4, 11] = float("nan")
    x[5, 3] = float("inf")
    x[6] = -1.0
    x[6, 40], x[6, 20] = 0.0, -0.0                   # equal maxima of either sign: the first
    for dt in (torch.float32, torch.bfloat16):
        y = x.to(dt)
        ids, nonfinite = cpu.argmax_rows(y)
        want, bad = plain_greedy_picks(y.float())
        assert nonfinite == bad == [2, 4, 5]
        assert [ids[b] for b in (0, 1, 3, 6)] == [want[b] for b in (0, 1, 3, 6)]
        assert ids[1] == 5 and ids[6] == 20
        for value in (float("nan"), float("inf"), float("-inf")):
            for col in (0, 77_000, 151_935):
                z = y[:1].clone()
                z[0, col] = value
                assert cpu.argmax_rows(z)[1] == [0], (dt, value, col)
        seqs = [FakeSeq(P(temperature=0)) for _ in range(7)]
        fast, plain = Sampler(cpu.argmax_rows)(y, seqs), Sampler()(y, seqs)
        assert [getattr(o, "token_id", None) for o in fast] == [getattr(o, "token_id", None) for o in plain]
        assert [getattr(o, "message", None) for o in fast] == [getattr(o, "message", None) for o in plain]
        assert fast[4].message == "the model produced a non-finite logit (nan) for this request"


def test_greedy_picks_and_nonfinite_rows_match_the_plain_torch_rules():
    from backend_lib.sampling.sampler import greedy_picks, nonfinite_rows, plain_greedy_picks

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 151936, generator=g)
    x[1, 5] = x[1, 9] = 100.0                        # a tie: the first index wins
    x[2] = float("-inf")
    x[2, 7] = -1e30                                  # a masked row with one allowed token
    x[3, :100] = 3e38                                # finite, but its sum overflows: not a bad row
    x[4, 11] = float("nan")
    x[5, 3] = float("inf")
    rows = [0, 1, 2, 3]
    assert greedy_picks(x, rows) == x[rows].argmax(dim=-1).tolist()
    assert greedy_picks(x[:4], rows) == x[:4].argmax(dim=-1).tolist()
    assert nonfinite_rows(x) == (~torch.isfinite(x).all(dim=-1)).nonzero().flatten().tolist() == [2, 4, 5]
    # the plain-greedy step's one numpy pass: the same picks (torch.argmax's rule) on the finite rows, the same bad rows
    picks, bad = plain_greedy_picks(x)
    assert bad == [2, 4, 5]
    assert [picks[b] for b in (0, 1, 3)] == x[[0, 1, 3]].argmax(dim=-1).tolist() and picks[1] == 5
    for value in (float("nan"), float("inf"), float("-inf")):   # each kind alone, anywhere in the row
        for col in (0, 77_000, 151_935):
            y = x[:1].clone()
            y[0, col] = value
            assert plain_greedy_picks(y)[1] == [0], (value, col)
