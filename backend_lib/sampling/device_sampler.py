"""The batched sampler for accelerators: one pass over a step's [B, V] logits where they are, per-row parameters
as small tensors, and one device-to-host copy of what the host needs (the ids, a few per-row flags and the
requested logprobs) instead of B x V logits.

It computes what `Sampler.__call__` computes, row for row and in the same order: the grammar's bitmask row,
repetition / presence / frequency penalties, the min_tokens block, greedy argmax, or temperature, top-k, min-p,
top-p and one inverse-CDF draw; logprobs (with the top N) from the raw logits. Every operation is per row, so
a row's token does not depend on what else is in its batch.

Randomness: each sampled row's uniform is drawn on the host from the request's own `torch.Generator`
(`Sequence.generator`, seeded by the request's seed), exactly the draw the host sampler makes (one float64 per
sampled step), and travels to the device with the other per-row parameters. So a seeded request's tokens
depend on its seed and its step only, never on its batch, and the device path gives the host sampler's
tokens given the same logits: the draw is the same number. (The filtered softmax and its CDF are computed
over the full sorted row with -inf past the kept ones, where the host sums only the kept ones; the sums can
round differently by an ulp, so a uniform within float rounding of a CDF boundary may pick the neighbouring
token. The tests compare ids over many seeded draws.)

Isolation: a row whose raw logits are not finite fails alone with the host sampler's message (the first bad
value travels back with the ids); a grammar that fails while its mask is filled fails its row alone; if the
device pass itself raises, the step falls back to the host sampler on the host copy of the logits.

Later per-row features slot in where `Sampler.__call__` has them: allowed_token_ids / bad words as bits
cleared in the row's bitmask (or indices set to -inf, as min_tokens is), logit_bias as a sparse add right after
the mask (before the penalties and the temperature). Until then a row carrying any of them sends the step to
the host sampler (`DeviceSampler.can_sample`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..contract.errors import RequestError
from .sampler import GRAMMAR_BLOCKED, Sample, SampleError, Sampler

log = logging.getLogger(__name__)

# columns of the one tensor that travels back (float64: ids < 2**53 and fp32 values are exact in it)
TOKEN, FINITE, BAD_VALUE, NONE_ALLOWED, LOGPROB, RANK, TOP = range(7)
HOST_ONLY_FIELDS = ("logit_bias", "allowed_token_ids", "bad_words_ids", "bad_words")


@dataclass
class StepRows:
    """A step's per-row sampling inputs, built on the host from the sequences and moved to the device together.

    temperature/top_p/min_p/rep/presence/frequency: fp32 [B]; top_k: int64 [B] (V when off); greedy, filtered:
    bool [B] (filtered: top-k, min-p or top-p, so the draw walks the sorted row); uniform: float64 [B];
    mask: int32 [B, ceil(V / 32)] or None (a bit per token, 1 = allowed); seen / outputs / blocked: flat
    indices row * V + token (repetition's prompt + output set, every output token for the counts, min_tokens'
    blocked ids); top_n: the largest logprobs N asked for (-1: no row wants logprobs)."""
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    rep: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    greedy: torch.Tensor
    filtered: torch.Tensor
    uniform: torch.Tensor
    mask: torch.Tensor | None
    seen: torch.Tensor
    outputs: torch.Tensor
    blocked: torch.Tensor
    top_n: int

    def to(self, device: torch.device) -> "StepRows":
        return StepRows(**{k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                           for k, v in vars(self).items()})


def _unpack_mask(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [B, V] from int32 bitmask rows (bit t % 32 of word t // 32; ids past the mask's end not allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    bits = ((mask.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()
    if bits.shape[1] < vocab:
        bits = torch.cat([bits, bits.new_zeros(bits.shape[0], vocab - bits.shape[1])], dim=1)
    return bits.narrow(1, 0, vocab)


def _set_flat(x: torch.Tensor, flat: torch.Tensor, value: float) -> torch.Tensor:
    if flat.numel():
        x = x.flatten().index_fill(0, flat, value).view_as(x)
    return x


def sample_batch(logits: torch.Tensor, rows: StepRows) -> torch.Tensor:
    """The device pass: float64 [B, TOP + 2 * max(top_n, 0)] (columns TOKEN ... TOP, then the top-N ids and their
    logprobs). Device-agnostic torch; nothing here reads a device value on the host (and no Python indexing:
    narrow / select / gather, which FakeTensorMode also runs on fake CUDA tensors)."""
    logits = logits.float()
    B, V = logits.shape
    dev = logits.device
    finite = torch.isfinite(logits)
    row_finite = finite.all(dim=-1)
    bad_value = logits.gather(1, finite.logical_not().int().argmax(dim=-1, keepdim=True)).squeeze(1)
    x = logits
    if rows.mask is not None:                                     # the grammar first, as the host sampler
        x = torch.where(_unpack_mask(rows.mask, V), x, float("-inf"))
    if rows.seen.numel():                                         # repetition over prompt + output
        seen = torch.zeros(B * V, dtype=torch.bool, device=dev).index_fill(0, rows.seen, True).view(B, V)
        r = rows.rep.unsqueeze(1)
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if rows.outputs.numel():                                      # presence / frequency over the output
        counts = torch.zeros(B * V, dtype=torch.float32, device=dev).index_add(
            0, rows.outputs, torch.ones_like(rows.outputs, dtype=torch.float32)).view(B, V)
        x = x - (rows.frequency.unsqueeze(1) * counts + rows.presence.unsqueeze(1) * (counts > 0).float())
    x = _set_flat(x, rows.blocked, float("-inf"))                 # min_tokens
    none_allowed = torch.isfinite(x).any(dim=-1).logical_not()
    greedy_ids = x.argmax(dim=-1)

    # temperature, then top-k / min-p / top-p over the row sorted once (stable: ties keep vocabulary order)
    big = torch.finfo(torch.float32).max
    t = torch.nan_to_num(x / rows.temperature.unsqueeze(1), nan=float("-inf"), posinf=big, neginf=float("-inf"))
    values, order = torch.sort(t, dim=-1, descending=True, stable=True)
    pos = torch.arange(V, device=dev).unsqueeze(0)
    keep = pos < rows.top_k.unsqueeze(1)
    probs = torch.softmax(torch.where(keep, values, float("-inf")), dim=-1)
    keep = keep & (probs >= rows.min_p.unsqueeze(1) * probs.narrow(1, 0, 1))   # min_p 0: every kept token passes
    keep = keep & ((probs.cumsum(dim=-1) - probs < rows.top_p.unsqueeze(1)) | (rows.top_p.unsqueeze(1) >= 1.0))
    keep = keep | (pos == 0)                                       # the most likely token stays
    filt = rows.filtered.unsqueeze(1)
    # unfiltered rows draw over the vocabulary in its own order, as the host sampler does
    final = torch.where(filt, torch.where(keep, values, float("-inf")), t)
    ids = torch.where(filt, order, pos.expand(B, V))
    n_keep = torch.where(rows.filtered, keep.sum(dim=-1), V)
    cdf = torch.softmax(final, dim=-1).cumsum(dim=-1)
    u = (rows.uniform * cdf.select(1, V - 1).double()).float()
    j = torch.minimum((cdf <= u.unsqueeze(1)).sum(dim=-1), n_keep - 1)
    sampled = ids.gather(1, j.unsqueeze(1)).squeeze(1)
    token = torch.where(rows.greedy, greedy_ids, sampled)

    cols = [token.double(), row_finite.double(), bad_value.double(), none_allowed.double()]
    if rows.top_n >= 0:
        lp = torch.log_softmax(logits, dim=-1)
        chosen = lp.gather(1, token.unsqueeze(1))
        cols.append(chosen.squeeze(1).double())
        cols.append(((lp > chosen).sum(dim=-1) + 1).double())   # the host sampler's rank: 1 = the most likely
        out = torch.stack(cols, dim=1)
        if rows.top_n > 0:
            top_vals, top_ids = torch.topk(lp, rows.top_n, dim=-1)
            out = torch.cat([out, top_ids.double(), top_vals.double()], dim=1)
        return out
    cols += [torch.zeros_like(cols[0]), torch.zeros_like(cols[0])]
    return torch.stack(cols, dim=1)


class DeviceSampler:
    """`Sampler.__call__`'s results with the logits left on their device (see the module docstring)."""

    def __init__(self, host: Sampler | None = None):
        self.host = host or Sampler()

    @staticmethod
    def can_sample(seqs: list) -> bool:
        """False where a row carries a per-row feature this pass does not apply yet (the host sampler does)."""
        return bool(seqs) and not any(getattr(s.params, f, None) for s in seqs for f in HOST_ONLY_FIELDS)

    def rows(self, seqs: list, vocab: int) -> tuple[StepRows, list[SampleError | None]]:
        """The host side: per-row parameters, the grammar masks and the uniforms (each row's failure its own)."""
        B = len(seqs)
        errors: list[SampleError | None] = [None] * B
        temp, top_k, top_p, min_p, rep, pres, freq, greedy, filtered, uniform = ([] for _ in range(10))
        seen, outputs, blocked = [], [], []
        mask = None
        for b, s in enumerate(seqs):
            p = s.params
            grammar = s.grammar if s.grammar is not None and s.grammar.active else None
            if grammar is not None:
                if mask is None:
                    mask = torch.full((B, (vocab + 31) // 32), -1, dtype=torch.int32)
                try:
                    grammar.fill_mask(mask[b])
                except RequestError as exc:   # names the request's own field
                    errors[b], mask[b] = SampleError(str(exc)), -1
                except Exception as exc:
                    errors[b], mask[b] = SampleError(f"structured_outputs: the grammar failed ({exc})"), -1
            base = b * vocab
            if p.repetition_penalty != 1.0:
                seen.extend(base + t for t in sorted(set(s.prompt_ids) | set(s.output_ids)))
            if p.presence_penalty or p.frequency_penalty:
                outputs.extend(base + t for t in s.output_ids)
            if len(s.output_ids) < p.min_tokens:
                blocked.extend(base + t for t in s.min_tokens_blocked_ids)
            k = p.top_k if p.top_k and p.top_k < vocab else vocab
            temp.append(1.0 if p.greedy else p.temperature)
            top_k.append(k)
            top_p.append(p.top_p)
            min_p.append(p.min_p)
            rep.append(p.repetition_penalty)
            pres.append(p.presence_penalty)
            freq.append(p.frequency_penalty)
            greedy.append(p.greedy)
            filtered.append(k < vocab or p.min_p > 0 or p.top_p < 1.0)
            # the host sampler's one draw per sampled step, from the request's own generator
            draw = not p.greedy and errors[b] is None
            uniform.append(torch.rand(1, generator=s.generator, dtype=torch.float64).item() if draw else 0.0)
        lp = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
        f32 = dict(dtype=torch.float32)
        i64 = dict(dtype=torch.int64)
        return StepRows(
            temperature=torch.tensor(temp, **f32), top_k=torch.tensor(top_k, **i64), top_p=torch.tensor(top_p, **f32),
            min_p=torch.tensor(min_p, **f32), rep=torch.tensor(rep, **f32), presence=torch.tensor(pres, **f32),
            frequency=torch.tensor(freq, **f32), greedy=torch.tensor(greedy, dtype=torch.bool),
            filtered=torch.tensor(filtered, dtype=torch.bool), uniform=torch.tensor(uniform, dtype=torch.float64),
            mask=mask, seen=torch.tensor(seen, **i64), outputs=torch.tensor(outputs, **i64),
            blocked=torch.tensor(blocked, **i64), top_n=max(lp) if lp else -1), errors

    def __call__(self, logits: torch.Tensor, seqs: list) -> list[Sample | SampleError]:
        """logits: [B, V] on any device, row b belongs to seqs[b]."""
        if not self.can_sample(seqs):
            return self.host(logits.cpu(), seqs)
        states = [s.generator.get_state() for s in seqs]
        rows, errors = self.rows(seqs, logits.shape[-1])
        try:
            packed = self.on_device(logits, rows)
        except Exception:   # never a failed step for want of the fast path
            log.exception("the device sampler failed; sampling this step on the host")
            for s, state in zip(seqs, states):    # the host sampler makes the step's draws again
                s.generator.set_state(state)
            return self.host(logits.cpu(), seqs)
        return unpack(packed, seqs, errors)

    @staticmethod
    def on_device(logits: torch.Tensor, rows: StepRows) -> torch.Tensor:
        """The per-row inputs moved to the logits' device, the pass, and the step's one device-to-host copy."""
        return sample_batch(logits, rows.to(logits.device)).cpu()


def unpack(packed: torch.Tensor, seqs: list, errors: list) -> list[Sample | SampleError]:
    """Samples (or the row's error, worded as the host sampler words it) from sample_batch's result."""
    out: list[Sample | SampleError] = []
    n_top = (packed.shape[1] - TOP) // 2
    for b, (s, row) in enumerate(zip(seqs, packed.tolist())):
        grammar = s.grammar is not None and s.grammar.active
        if not row[FINITE]:
            out.append(SampleError(f"the model produced a non-finite logit ({row[BAD_VALUE]}) for this request"))
        elif errors[b] is not None:
            out.append(errors[b])
        elif grammar and row[NONE_ALLOWED]:
            out.append(SampleError(GRAMMAR_BLOCKED))
        else:
            sample = Sample(int(row[TOKEN]))
            n = s.params.logprobs
            if n is not None:
                sample.logprob = row[LOGPROB]
                sample.rank = int(row[RANK])
                sample.top_logprobs = [(int(i), v) for i, v in zip(row[TOP:TOP + n], row[TOP + n_top:TOP + n_top + n])]
            out.append(sample)
    return out
