"""The one sampling pipeline: a step's logits and its SamplingMetadata (metadata.py) in, one Sample or SampleError
per logits row out, on whatever device the logits are on.

A fixed sequence of ops over the batch, in the order every row has always been processed in: the model's own
output checked (a row with a NaN or an infinity fails), the grammar's bitmask, allowed_token_ids, bad words,
logit_bias, the repetition penalty (prompt + output), presence and frequency penalties (output), the min_tokens
block, then a check that a constrained row kept a token; greedy rows take the argmax; sampled rows divide by
their temperature, keep top-k (the k largest, `torch.topk`), then min-p and top-p over the sorted row (the most
likely token always stays, so no filter can leave a row empty; values that overflow are clamped first), and
draw by inverse CDF with their own uniform (drawn from the request's generator in the metadata); logprobs (the
sampled token's, its rank, the top N) come from the raw logits.

Every op is per row: a row's values depend on its own logits and parameters only, never on its batch (so a
seeded request samples the same tokens whatever shares its step), and each is written once, over the batch.
The per-row filters are batched without changing a row's bits: rows are grouped by what the host would call on
them (`topk` with their own k, a full `sort`, or neither), and a filtered row's kept prefix is padded with -inf
instead of cut out (a softmax and a cumsum over a padded row give the cut row's bits).

Where the logits are on an accelerator (`sync_free`, the default off the CPU) nothing reads a device value on
the host until the one device-to-host copy of the results (ids, per-row flags, the requested logprobs: B rows,
never B x vocab logits); tests/test_no_host_sync.py holds it to that. On the CPU the same ops read what is
cheap to read: the non-finite rows by one summing pass, numpy's argmax for greedy rows, the grammar mask
applied with numpy, a filtered draw narrowed to its widest kept prefix. Both give the same bits.

Isolation: a row whose logits are not finite, whose grammar fails or forbids every token fails alone with its
own message; should a batched op raise, each row is sampled again alone (the same draws: the metadata holds
them) and only the rows that still fail get a SampleError.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from .metadata import ALLOWED_BLOCKED, GRAMMAR_BLOCKED, SampleError, SamplingMetadata, SamplingRow
from .structured import apply_mask

log = logging.getLogger(__name__)

__all__ = ["GRAMMAR_BLOCKED", "Sample", "SampleError", "Sampler", "SamplingMetadata", "greedy_picks",
           "nonfinite_rows", "plain_greedy", "plain_greedy_picks"]


@dataclass
class Sample:
    token_id: int
    logprob: float | None = None
    rank: int | None = None                # of the sampled token among all, 1 = the most likely
    top_logprobs: list[tuple[int, float]] | None = None


def nonfinite_rows(logits: torch.Tensor) -> list[int]:
    """Rows of fp32 [B, V] logits holding a NaN or an infinity. A row's sum is non-finite whenever the row is
    (and, rarely, when finite values overflow it): one summing pass instead of a [B, V] mask, then the exact
    check on the rows it flags (torch's isfinite + all is ~50x slower than the sum over 151,936 logits here)."""
    suspects = (~torch.isfinite(logits.sum(dim=-1))).nonzero().flatten().tolist()
    return [b for b in suspects if not bool(torch.isfinite(logits[b]).all())]


def greedy_picks(logits: torch.Tensor, rows: list[int]) -> list[int]:
    """The first index of each row's maximum (torch.argmax's rule), through numpy's vectorized argmax: torch's
    CPU argmax over 151,936 fp32 logits took ~0.2-0.3 ms a row here, numpy's ~7 us."""
    x = logits.detach().cpu().numpy()
    return [int(i) for i in np.argmax(x[rows] if len(rows) != x.shape[0] else x, axis=-1)]


def plain_greedy_picks(logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """(each row's first index of its maximum, the rows holding a NaN or an infinity) of fp32 [B, V] CPU logits, in
    two single-threaded numpy passes: the argmax (numpy's maximum is a row's first NaN, so its value is NaN there,
    and +inf where the row holds one), then the minimum (-inf where the row holds one). The rules of greedy_picks
    and nonfinite_rows, for a step whose rows only argmax: ~0.1 ms a step less than torch's parallel sum right
    after the head (0.6B demo, 2-core AVX-512 VM: docs/performance.md)."""
    x = logits.detach().numpy()
    idx = np.argmax(x, axis=-1)
    top = np.take_along_axis(x, idx[:, None], axis=-1)[:, 0]
    bad = ~(np.isfinite(top) & np.isfinite(x.min(axis=-1)))
    return idx.tolist(), np.flatnonzero(bad).tolist()


def _nonfinite_message(row: torch.Tensor) -> str:
    return f"the model produced a non-finite logit ({row[~torch.isfinite(row)][0].item()}) for this request"


def plain_greedy(s) -> bool:
    """A row the pipeline would only argmax: greedy, no penalty, no min_tokens block, no token mask, no grammar,
    no logprobs."""
    p = s.params
    return (p.greedy and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
            and len(s.output_ids) >= p.min_tokens and p.logprobs is None and not p.allowed_token_ids
            and not p.bad_words_ids and not p.logit_bias and not (s.grammar is not None and s.grammar.active))


def _finite(x: torch.Tensor) -> torch.Tensor:
    """Overflowed values (penalties, tiny temperatures) clamped to the largest finite ones; NaN dropped."""
    big = torch.finfo(x.dtype).max
    return torch.nan_to_num(x, nan=float("-inf"), posinf=big, neginf=float("-inf"))


def _unpack_mask(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [R, V] from int32 bitmask rows (bit t % 32 of word t // 32; ids past the mask's end not allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    bits = ((mask.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()
    if bits.shape[1] < vocab:
        bits = torch.cat([bits, bits.new_zeros(bits.shape[0], vocab - bits.shape[1])], dim=1)
    return bits.narrow(1, 0, vocab)


class _Inputs:
    """Host lists (the metadata's) as tensors where the logits are: host-to-device copies, never the reverse."""

    def __init__(self, device: torch.device):
        self.device = device

    def long(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def f32(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device)

    def f64(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64, device=self.device)


def _flat(rows: list[SamplingRow], picked, ids_of, V: int) -> tuple[list[int], list[int]]:
    """Flat indices row * V + token of each picked row's ids, and the picked row of each (for per-index values)."""
    flat, owner = [], []
    for r in picked:
        ids = ids_of(rows[r])
        base = r * V
        flat.extend(base + t for t in ids)
        owner.extend([r] * len(ids))
    return flat, owner


def _draw(vals: torch.Tensor, ids: torch.Tensor | None, top_p: torch.Tensor | None, min_p: torch.Tensor | None,
          u: torch.Tensor, narrow: bool) -> torch.Tensor:
    """One inverse-CDF draw per row of `vals` [G, L] (sorted descending when filtered; ids: the token of each
    column, None for the vocabulary's own order). min_p / top_p (fp32 [G], None: no row filters): the kept
    prefix (the most likely token always kept), the rest -inf. `narrow` (host only): the softmax and the CDF
    over the widest kept prefix instead of all L > 1024 columns (the same bits: the columns past it are -inf)."""
    G, L = vals.shape
    if top_p is not None:
        probs = torch.softmax(vals, dim=-1)
        keep = probs >= min_p.unsqueeze(1) * probs.narrow(1, 0, 1)        # min_p 0: every token passes
        keep &= (probs.cumsum(dim=-1) - probs) < top_p.unsqueeze(1)        # top_p off: 2.0, every token passes
        keep.select(1, 0).fill_(True)
        n_keep = keep.sum(dim=-1)
        if narrow and L > 1024:
            w = int(n_keep.max())
            vals, keep = vals.narrow(1, 0, w), keep.narrow(1, 0, w)
            ids = ids.narrow(1, 0, w)
        vals = torch.where(keep, vals, float("-inf"))
        last = n_keep - 1
    else:
        last = torch.full((G,), L - 1, dtype=torch.int64, device=vals.device)
    cdf = torch.softmax(vals, dim=-1).cumsum(dim=-1)
    total = cdf.select(1, -1)
    target = (u * total.double()).float()
    j = torch.minimum(torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1), last)
    return j if ids is None else ids.gather(1, j.unsqueeze(1)).squeeze(1)


class Sampler:
    def __init__(self, argmax_rows=None):
        """argmax_rows: a kernel set's slot of that name (kernels/contract.py) for steps of plain greedy CPU rows;
        None: plain_greedy_picks."""
        self._mask = torch.empty((0, 0), dtype=torch.int32)
        self.argmax_rows = argmax_rows

    def _mask_buffer(self, n: int, vocab: int) -> torch.Tensor:
        """Grammar bitmask rows, one buffer reused from step to step (grown when a step needs more rows)."""
        W = (vocab + 31) // 32
        if self._mask.shape[1] != W or self._mask.shape[0] < n:
            self._mask = torch.empty((n, W), dtype=torch.int32)
        return self._mask[:n]

    def metadata(self, seqs: list, vocab: int, drafts: list[list[int]] | None = None) -> SamplingMetadata:
        return SamplingMetadata.build(seqs, vocab, drafts, lambda n: self._mask_buffer(n, vocab))

    def __call__(self, logits: torch.Tensor, seqs: list, drafts: list[list[int]] | None = None,
                 sync_free: bool | None = None) -> list[Sample | SampleError]:
        """logits: [R, V] on any device. Without drafts row b belongs to seqs[b]; with drafts (speculative
        verification) sequence i has len(drafts[i]) + 1 rows in position order (SamplingMetadata.build)."""
        if sync_free is None:
            sync_free = logits.device.type != "cpu"
        if drafts is None and not sync_free and all(plain_greedy(s) for s in seqs):
            return self._plain_greedy_step(logits, seqs)
        return self.sample(logits, self.metadata(seqs, logits.shape[-1], drafts), sync_free)

    def _plain_greedy_step(self, logits: torch.Tensor, seqs: list) -> list[Sample | SampleError]:
        """The pipeline's ops a step of plain greedy rows runs, without building its metadata (the commonest
        step: the non-finite check, then the argmax): the kernel set's argmax_rows in one read of the logits where
        it has one, else plain_greedy_picks."""
        out: list[Sample | SampleError | None] = [None] * len(seqs)
        if (self.argmax_rows is not None and logits.device.type == "cpu"
                and logits.dtype in (torch.float32, torch.bfloat16)):
            picks, bad = self.argmax_rows(logits)
        else:
            picks, bad = plain_greedy_picks(logits.float())
        for b in bad:
            out[b] = SampleError(_nonfinite_message(logits[b]))
        return [o if o is not None else Sample(t) for o, t in zip(out, picks)]

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata,
               sync_free: bool | None = None) -> list[Sample | SampleError]:
        """One result per row of `meta` (logits row r is meta.rows[r]); sync_free: default off the CPU."""
        if sync_free is None:
            sync_free = logits.device.type != "cpu"
        try:
            return self._results(meta, *self.device_pass(logits, meta, sync_free))
        except Exception as exc:
            if len(meta.rows) == 1:
                return [meta.rows[0].error or SampleError(f"sampling failed ({exc})")]
            log.exception("the batched sampling of %d rows failed; sampling each row alone", len(meta.rows))
        out: list[Sample | SampleError] = []
        for r in range(len(meta.rows)):
            out.extend(self.sample(logits.narrow(0, r, 1), meta.subset([r]), sync_free))
        return out

    @staticmethod
    def _rows(x: torch.Tensor, picked: list[int], put: _Inputs) -> torch.Tensor:
        """Rows `picked` of x (x itself, a one-row view, or a gathered copy)."""
        if len(picked) == x.shape[0]:
            return x
        return x.narrow(0, picked[0], 1) if len(picked) == 1 else x.index_select(0, put.long(picked))

    def device_pass(self, logits: torch.Tensor, meta: SamplingMetadata, sync_free: bool):
        """The ops over the batch, where the logits are: (the results as host lists, None), or sync_free (None,
        the one [B, 6 + 2N] float64 tensor copied to the host: token, finite, bad value, none allowed, logprob,
        rank, then the top-N ids and logprobs)."""
        logits = logits.float()
        B, V = logits.shape
        rows = meta.rows
        dev = logits.device
        put = _Inputs(dev)
        packed: list[torch.Tensor] = []     # sync_free: the [B] columns that travel back together

        # the model's own output (not a parameter) is broken for this row
        bad_rows: list[int] = []
        if sync_free:
            finite = torch.isfinite(logits)
            packed.append(finite.all(dim=-1).double())
            packed.append(logits.gather(1, finite.logical_not().int().argmax(dim=-1, keepdim=True)).squeeze(1).double())
        else:
            bad_rows = nonfinite_rows(logits)

        x = logits
        processed = [r for r in range(B) if rows[r].processed]
        if processed:
            x = logits.clone(memory_format=torch.contiguous_format)
            xf = x.view(-1)
            grammar = [r for r in processed if rows[r].mask is not None]
            if grammar:                       # first, as vLLM does: the penalties then see only what it allows
                if sync_free:
                    g = put.long(grammar)
                    mask = meta.mask if meta.mask.device == dev else meta.mask.to(dev, non_blocking=True)
                    bits = _unpack_mask(mask.index_select(0, put.long([rows[r].mask for r in grammar])), V)
                    x.index_copy_(0, g, torch.where(bits, x.index_select(0, g), float("-inf")))
                else:
                    for r in grammar:
                        apply_mask(x[r], meta.mask[rows[r].mask])
            allowed = [r for r in processed if rows[r].allowed]
            if allowed:                       # everything else -inf
                flat, _ = _flat(rows, allowed, lambda row: row.allowed, V)
                flat_t = put.long(flat)
                keep = xf.index_select(0, flat_t)
                x.index_fill_(0, put.long(allowed), float("-inf"))
                xf.index_copy_(0, flat_t, keep)
            banned, _ = _flat(rows, processed, lambda row: row.banned or (), V)
            if banned:
                xf.index_fill_(0, put.long(banned), float("-inf"))
            bias, owner = _flat(rows, processed, lambda row: row.bias[0] if row.bias else (), V)
            if bias:
                values = [v for r in processed if rows[r].bias for v in rows[r].bias[1]]
                xf.index_add_(0, put.long(bias), put.f32(values))
            seen, owner = _flat(rows, processed, lambda row: row.seen or (), V)
            if seen:                          # repetition over prompt + output
                seen_t = put.long(seen)
                rep = put.f32([rows[r].repetition for r in owner])
                vals = xf.index_select(0, seen_t)
                xf.index_copy_(0, seen_t, torch.where(vals > 0, vals / rep, vals * rep))
            counted, owner = _flat(rows, processed, lambda row: row.counts[0] if row.counts else (), V)
            if counted:                       # presence / frequency over the output
                counted_t = put.long(counted)
                counts = put.f32([c for r in processed if rows[r].counts for c in rows[r].counts[1]])
                penalty = put.f32([rows[r].frequency for r in owner]) * counts + put.f32([rows[r].presence for r in owner])
                xf.index_copy_(0, counted_t, xf.index_select(0, counted_t) - penalty)
            blocked, _ = _flat(rows, processed, lambda row: row.blocked or (), V)
            if blocked:                       # min_tokens
                xf.index_fill_(0, put.long(blocked), float("-inf"))

        constrained = [r for r in range(B) if rows[r].constrained]
        none_allowed: list[int] = []
        if sync_free:
            flag = torch.zeros(B, dtype=torch.float64, device=dev)
            if constrained:
                c = put.long(constrained)
                flag.index_copy_(0, c, torch.isfinite(x.index_select(0, c)).any(dim=-1).logical_not().double())
            packed.append(flag)
        else:
            none_allowed = [r for r in constrained if not np.isfinite(x[r].numpy()).any()]

        # the token of each row: greedy argmax, or a draw per group of rows filtered alike
        token = torch.zeros(B, dtype=torch.int64, device=dev) if sync_free else None
        tokens: list[int] = [0] * B
        greedy = [r for r in range(B) if rows[r].greedy]
        if greedy:
            if sync_free:
                g = put.long(greedy)
                token.index_copy_(0, g, x.index_select(0, g).argmax(dim=-1))
            else:
                for r, t in zip(greedy, greedy_picks(x, greedy)):
                    tokens[r] = t
        sampled = [r for r in range(B) if not rows[r].greedy]
        if sampled:
            groups: dict = {}
            for i, r in enumerate(sampled):
                row = rows[r]
                if row.top_k and row.top_k < V:
                    key = row.top_k
                elif row.min_p > 0 or row.top_p < 1.0:
                    key = "sort"
                else:
                    key = "plain"
                groups.setdefault(key, []).append(i)
            # Off the CPU a group is one batch. On the CPU the vocabulary-wide ops (temperature, clamp, sort or
            # top-k) run one row at a time (a batch's V-wide temporaries cost the host allocator fresh pages at
            # every op, ~4x the row's time), a top-k group's draw over its k columns once for the group.
            for key, members in groups.items():
                where = [sampled[i] for i in members]
                wide = key in ("plain", "sort") and not sync_free
                for chunk in ([[r] for r in where] if wide else [where]):
                    picked = [rows[r] for r in chunk]
                    if sync_free or wide:
                        tg = _finite(self._rows(x, chunk, put) / put.f32([row.temperature for row in picked]).unsqueeze(1))
                        vals, ids = (tg, None) if key == "plain" else (
                            torch.sort(tg, dim=-1, descending=True) if key == "sort" else torch.topk(tg, key, dim=-1))
                    else:
                        tops = [torch.topk(_finite(x.narrow(0, r, 1) / row.temperature), key, dim=-1)
                                for r, row in zip(chunk, picked)]
                        vals, ids = tops[0] if len(tops) == 1 else (torch.cat([v for v, _ in tops]),
                                                                    torch.cat([i for _, i in tops]))
                    filt = key != "plain" and any(row.min_p > 0 or row.top_p < 1.0 for row in picked)
                    got = _draw(vals, ids, put.f32([row.top_p if row.top_p < 1.0 else 2.0 for row in picked])
                                if filt else None, put.f32([row.min_p for row in picked]) if filt else None,
                                put.f64([row.uniform for row in picked]), not sync_free)
                    if sync_free:
                        token.index_copy_(0, put.long(chunk), got)
                    else:
                        for r, tok in zip(chunk, got.tolist()):
                            tokens[r] = tok

        # logprobs from the raw logits: the sampled token's, its rank (1 = the most likely) and the top N
        lp_rows = [r for r in range(B) if rows[r].logprobs is not None]
        top_n = max((rows[r].logprobs for r in lp_rows), default=0)
        lp_vals = lp_rank = top_ids = top_vals = None
        if lp_rows:
            lp_t = put.long(lp_rows)
            lp = torch.log_softmax(logits.index_select(0, lp_t), dim=-1)
            chosen_ids = token.index_select(0, lp_t) if sync_free else put.long([tokens[r] for r in lp_rows])
            chosen = lp.gather(1, chosen_ids.unsqueeze(1))
            lp_vals, lp_rank = chosen.squeeze(1), (lp > chosen).sum(dim=-1) + 1
            if top_n:
                top_ids = torch.zeros((len(lp_rows), top_n), dtype=torch.int64, device=dev)
                top_vals = torch.zeros((len(lp_rows), top_n), dtype=torch.float32, device=dev)
                by_n: dict[int, list[int]] = {}
                for i, r in enumerate(lp_rows):
                    if rows[r].logprobs:
                        by_n.setdefault(rows[r].logprobs, []).append(i)
                for n, members in by_n.items():    # each row its own N (topk's order of ties depends on N)
                    m = put.long(members)
                    v, ids = torch.topk(lp if len(members) == len(lp_rows) else lp.index_select(0, m), n, dim=-1)
                    top_ids.narrow(1, 0, n).index_copy_(0, m, ids)
                    top_vals.narrow(1, 0, n).index_copy_(0, m, v)

        if sync_free:    # the step's one device-to-host copy
            cols = [token.double()] + packed
            host = torch.stack(cols, dim=1)
            if lp_rows:
                extra = torch.zeros((B, 2 + 2 * top_n), dtype=torch.float64, device=dev)
                parts = [lp_vals.double().unsqueeze(1), lp_rank.double().unsqueeze(1)]
                if top_n:
                    parts += [top_ids.double(), top_vals.double()]
                extra.index_copy_(0, put.long(lp_rows), torch.cat(parts, dim=1))
                host = torch.cat([host, extra], dim=1)
            return None, host.cpu()
        bad_value = {r: _nonfinite_message(logits[r]) for r in bad_rows}
        lp_host = {}
        if lp_rows:
            v, k = lp_vals.tolist(), lp_rank.tolist()
            ti = top_ids.tolist() if top_n else [[]] * len(lp_rows)
            tv = top_vals.tolist() if top_n else [[]] * len(lp_rows)
            lp_host = {r: (v[i], k[i], ti[i], tv[i]) for i, r in enumerate(lp_rows)}
        return (tokens, bad_value, none_allowed, lp_host), None

    @staticmethod
    def _results(meta: SamplingMetadata, lists, packed: torch.Tensor | None) -> list[Sample | SampleError]:
        """A Sample, or the row's error, per row (errors first as the ops meet them: the model's own output,
        then the metadata's, then a constrained row left without a token)."""
        rows = meta.rows
        B = len(rows)
        if packed is not None:
            host = packed.tolist()
            top_n = (packed.shape[1] - 6) // 2
            tokens = [int(h[0]) for h in host]
            bad_value = {r: f"the model produced a non-finite logit ({host[r][2]}) for this request"
                         for r in range(B) if not host[r][1]}
            none_allowed = [r for r in range(B) if host[r][3]]
            lp_host = {r: (host[r][4], int(host[r][5]), host[r][6:6 + top_n], host[r][6 + top_n:6 + 2 * top_n])
                       for r in range(B) if rows[r].logprobs is not None}
        else:
            tokens, bad_value, none_allowed, lp_host = lists
        out: list[Sample | SampleError] = []
        bad, blocked_rows = bad_value, set(none_allowed)
        for r, row in enumerate(rows):
            if r in bad:
                out.append(SampleError(bad_value[r]))
            elif row.error is not None:
                out.append(row.error)
            elif r in blocked_rows:
                out.append(SampleError(GRAMMAR_BLOCKED if row.mask is not None else ALLOWED_BLOCKED))
            else:
                sample = Sample(tokens[r])
                if row.logprobs is not None:
                    value, rank, ids, vals = lp_host[r]
                    n = row.logprobs
                    sample.logprob, sample.rank = value, int(rank)
                    sample.top_logprobs = [(int(i), v) for i, v in zip(ids[:n], vals[:n])]
                out.append(sample)
        return out
