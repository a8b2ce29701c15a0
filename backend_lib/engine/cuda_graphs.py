"""Steps replayed from CUDA graphs, captured per bucket at the bucket's first use over static input buffers,
then replayed with the step's inputs copied in. The kernels are batch invariant, so a step padded to its bucket
gives the real rows the same bits as the unpadded eager step; padding writes nothing to the KV cache (slot -1:
the Triton KV writes skip it) and its logits are dropped. Prefill and mixed prefill steps stay eager.

DecodeGraphs: pure decode steps, one graph per batch bucket (1, 2, 4, ..., >= max_num_seqs). Rows past the
step's batch are padding (cached length -1: no KV write, position 0, one key of page 0 read).

VerifyGraphs ([spec], docs/speculative.md): verification steps, one graph per batch bucket n with k + 1 rows
per sequence (k = num_speculative_tokens): n * (k + 1) + 1 query rows over n + 1 sequence slots. The step's
sequences come first, each with exactly the rows the eager step gives it (its last token and its drafts: k + 1
rows, fewer when the scheduler or the proposer gave it fewer drafts, 1 for a plain decode row in the same
step), packed back to back as in ModelRunner.prepare; then each unused sequence slot is a padding sequence of
one row, and the last slot (the sink) takes every row left over (at least one). Padding rows have slot -1,
position 0 and read only page 0 (a zero table row); their logits are dropped. Why packed, not padded inside
each sequence's k + 1 slots: a padding row inside a sequence would share the real rows' attention tile and
widen its key range over positions nothing wrote (read with weight 0: exact only while every stale value is
finite) and, near max_model_len, past its table; packed, every real sequence's attention programs read the
query layout, lengths and keys of the eager step's, and the query layout (device buffers, read by the kernel)
changes between replays without a new graph. Why not eager for a row with fewer than k drafts: the n-gram
proposer drafts fewer than k, or none, for many rows of a step, so those steps would rarely replay. A padded
bucket computes n * (k + 1) + 1 rows whatever the step's real rows (the cost of one graph per bucket).

[spec] EAGLE-3 (the runner's aux_layers set: its head reads the target's aux hidden states): both kinds capture
forward_aux instead of forward, and the graph copies the aux states [rows, len(aux_layers) * hidden] into one
static buffer (the largest bucket's rows; each bucket writes its first rows), from which `run` hands a copy of
the real rows back (the next replay overwrites the buffer). The hidden, logits and aux bits of the real rows are
the eager forward_aux's (padding rows are rows of their own: batch invariance). Such an engine's graphs always
compute the aux, also in a step whose requests all opted out (the runner then drops it, as padding logits).
Graphs are keyed by (bucket, aux layers).

Eager instead (the runner decides, or `fits` says no): steps with a prefill chunk, LoRA rows, a sequence with
more than k drafts or a table wider than max_model_len, and every step after a failed capture of that kind
(logged). The draft model's own forwards (and an EAGLE-3 head's) are eager.

Used with the Triton kernel set on CUDA (`cuda_graphs`, default on). `capture=False` runs the same padded
buffers eagerly: how the CPU tests prove the padding (tests/test_cuda_graphs.py, tests/test_verify_graphs.py).
The capture itself has not run on a GPU yet.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..kv_cache.metadata import AttentionMetadata

log = logging.getLogger(__name__)


def buckets(max_num_seqs: int) -> list[int]:
    out = [1]
    while out[-1] < max_num_seqs:
        out.append(out[-1] * 2)
    return out


def step_rows(seq, n: int, page_size: int) -> tuple[list[int], list[int], list[int]]:
    """(ids, positions, KV slots) of seq's n rows in a step from its num_computed (the drafts after its tokens):
    what ModelRunner.prepare and the verification graphs both give the model."""
    start = seq.num_computed
    tokens = seq.tokens + seq.spec_tokens if seq.spec_tokens else seq.tokens
    bt = seq.block_table
    return (tokens[start:start + n], list(range(start, start + n)),
            [bt[p // page_size] * page_size + p % page_size for p in range(start, start + n)])


class _Graphs:
    """One graph per bucket (and aux layers): captured at its first use, replayed after; eager from a failed
    capture on. A step gives (fp32 logits [rows, vocab], the aux states in the static buffer [rows, width] or
    None without aux layers)."""
    kind = ""

    def __init__(self, runner, capture: bool, max_rows: int):
        self.runner, self.capture, self.max_rows = runner, capture, max_rows
        self.graphs: dict[tuple, tuple] = {}
        self.failed = False
        self.aux_buf: torch.Tensor | None = None      # [spec] EAGLE-3: the aux states' static buffer
        self.aux_key: tuple[int, ...] | None = None   # the aux layers it was allocated for

    @property
    def aux_layers(self) -> tuple[int, ...] | None:
        return self.runner.aux_layers

    def aux_buffer(self) -> torch.Tensor | None:
        """[spec] The static aux buffer of the runner's aux layers, allocated outside any capture (every graph
        writes into this one tensor); None without aux layers."""
        layers = self.aux_layers
        if layers is None:
            return None
        if self.aux_buf is None or self.aux_key != layers:
            model = self.runner.model
            self.aux_buf = torch.zeros((self.max_rows, len(layers) * model.cfg.hidden_size), dtype=model.dtype,
                                       device=self.runner.device)
            self.aux_key = layers
        return self.aux_buf

    def _step(self, n: int, aux_layers: tuple[int, ...] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits, aux states or None) of bucket n's rows over the static inputs."""
        raise NotImplementedError

    def _outputs(self, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a graph holds: the step, its aux states copied into the static buffer's first rows."""
        logits, aux = self._step(n, self.aux_layers)
        if aux is None:
            return logits, None
        out = self.aux_buf.narrow(0, 0, aux.shape[0])
        out.copy_(aux)
        return logits, out

    def _replay(self, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.aux_buffer()
        if not self.capture:
            return self._outputs(n)
        key = (n, self.aux_layers)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(n)
            except RuntimeError as exc:     # never a broken engine for want of a graph: eager from here on
                log.warning("CUDA graph capture of the bucket-%d %s step failed (%s); running those steps eagerly",
                            n, self.kind, exc)
                self.failed = True
                return self._outputs(n)
        graph, out = self.graphs[key]
        graph.replay()
        return out

    def _capture(self, n: int):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):      # warm-up: Triton compiles its variants, the allocator settles
            self._outputs(n)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._outputs(n)
        log.info("captured the bucket-%d %s step%s as a CUDA graph", n, self.kind,
                 "" if out[1] is None else " with its aux states")
        return graph, out


def _kept(aux: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """[spec] The real rows of the static aux buffer, copied out: the next replay overwrites the buffer."""
    return None if aux is None else aux[:rows].clone()


class DecodeGraphs(_Graphs):
    kind = "decode"

    def __init__(self, runner, max_num_seqs: int, max_pages: int, capture: bool = True):
        self.buckets = buckets(max_num_seqs)
        super().__init__(runner, capture, self.buckets[-1])
        n, dev = self.buckets[-1], runner.device
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.tables = torch.zeros((n, max_pages), dtype=torch.int32, device=dev)
        self.context = torch.full((n,), -1, dtype=torch.int32, device=dev)

    def fits(self, batch: int, width: int) -> bool:
        return not self.failed and batch <= self.buckets[-1] and width <= self.tables.shape[1]

    def run(self, ids: torch.Tensor, tables: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(fp32 logits [B, vocab], [spec] the aux states [B, width] with aux layers, else None) of a decode step
        (device tensors in, as ModelRunner.decode_inputs gives)."""
        b, w = tables.shape
        n = next(k for k in self.buckets if k >= b)
        self.ids[:b].copy_(ids)
        self.tables[:b, :w].copy_(tables)
        self.tables[:b, w:].zero_()
        self.context[:b].copy_(context)
        self.context[b:n].fill_(-1)
        logits, aux = self._replay(n)
        return logits[:b], _kept(aux, b)

    def _step(self, n: int, aux_layers):
        ids, tables, context = self.ids[:n], self.tables[:n], self.context[:n]
        if aux_layers is None:
            return self.runner.decode_logits(ids, tables, context), None
        meta, positions = AttentionMetadata.for_decode(tables, context, self.runner.page_size)
        return self.runner.step_logits_aux(ids, positions, meta, aux_layers)


@dataclass
class VerifyLayout:
    """A verification step laid out in its bucket (host lists): n sequence slots + the sink, n * (k + 1) + 1 rows."""
    bucket: int
    rows: int                  # the real rows (the step's sequences' rows, first): the logits kept
    ids: list[int]
    positions: list[int]
    slots: list[int]           # -1 for every padding row
    query_start_loc: list[int]  # [n + 2]
    seq_lens: list[int]        # [n + 1]
    tables: list[list[int]]    # the step's sequences' block tables (the padding's rows are zeros)


def verify_layout(plan, bucket_sizes: list[int], per_seq: int, page_size: int) -> VerifyLayout:
    """plan [(seq, rows)] in its bucket: the smallest of bucket_sizes holding its sequences, per_seq = k + 1 rows
    a sequence slot, plus the sink's row (the module docstring)."""
    m = len(plan)
    n = next(b for b in bucket_sizes if b >= m)
    total = n * per_seq + 1
    ids, positions, slots, qsl, lens = [], [], [], [0], []
    for seq, rows in plan:
        i, p, s = step_rows(seq, rows, page_size)
        ids += i
        positions += p
        slots += s
        qsl.append(qsl[-1] + rows)
        lens.append(seq.num_computed + rows)
    real = len(ids)
    for _ in range(n - m):             # padding sequences: one row each
        qsl.append(qsl[-1] + 1)
        lens.append(1)
    lens.append(total - qsl[-1])       # the sink: the rest, >= (n - m) * k + 1 rows, at positions 0 ..
    qsl.append(total)
    pad = total - real
    return VerifyLayout(n, real, ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad, qsl, lens,
                        [seq.block_table for seq, _ in plan])


class VerifyGraphs(_Graphs):
    """[spec] Verification steps (the module docstring): one graph per batch bucket, k + 1 rows a sequence."""
    kind = "verification"

    def __init__(self, runner, max_num_seqs: int, max_pages: int, num_speculative_tokens: int,
                 capture: bool = True):
        self.buckets = buckets(max_num_seqs)
        self.per_seq = num_speculative_tokens + 1
        super().__init__(runner, capture, self.num_rows(self.buckets[-1]))
        self.max_pages, self.page_size = max_pages, runner.page_size
        n, dev = self.buckets[-1], runner.device
        t = self.num_rows(n)
        # the sink's rows read keys 0 .. its rows - 1, all through page 0: its zero table row covers them
        width = max(max_pages, -(-t // self.page_size))
        self.tokens = torch.zeros((3, t), dtype=torch.int64, device=dev)       # ids, positions, slots
        self.layout_buf = torch.zeros((2, n + 2), dtype=torch.int32, device=dev)  # query_start_loc, seq_lens
        self.tables = torch.zeros((n + 1, width), dtype=torch.int32, device=dev)

    def num_rows(self, n: int) -> int:
        return n * self.per_seq + 1     # verify_layout's rows: n sequence slots and the sink's row

    def fits(self, plan) -> bool:
        """Whether plan [(seq, rows)] is a verification step this holds: every sequence decoding (its last token)
        with its drafts, at most k, at least one sequence with drafts, every table within max_model_len."""
        if self.failed or not plan or len(plan) > self.buckets[-1]:
            return False
        drafts = False
        for seq, n in plan:
            k = len(seq.spec_tokens)
            if seq.num_pending != 1 or n != k + 1 or n > self.per_seq or len(seq.block_table) > self.max_pages:
                return False
            drafts = drafts or k > 0
        return drafts

    def layout(self, plan) -> VerifyLayout:
        return verify_layout(plan, self.buckets, self.per_seq, self.page_size)

    def run(self, plan) -> tuple[torch.Tensor, list, torch.Tensor | None]:
        """(fp32 logits [rows, vocab] of the step's rows, in step order; each row's sequence; [spec] their aux
        states [rows, width] with aux layers, else None), as the eager step's prepare + forward (forward_aux)
        give them (plan: fits(plan))."""
        lay = self.layout(plan)
        n, total, m = lay.bucket, self.num_rows(lay.bucket), len(lay.tables)
        width = max(len(t) for t in lay.tables)
        tables = torch.zeros((m, width), dtype=torch.int32)
        for b, t in enumerate(lay.tables):
            tables[b, :len(t)] = torch.tensor(t, dtype=torch.int32)
        self.tokens[:, :total].copy_(torch.tensor([lay.ids, lay.positions, lay.slots], dtype=torch.int64))
        self.layout_buf[0, :n + 2].copy_(torch.tensor(lay.query_start_loc, dtype=torch.int32))
        self.layout_buf[1, :n + 1].copy_(torch.tensor(lay.seq_lens, dtype=torch.int32))
        self.tables[:m, :width].copy_(tables)
        self.tables[:m, width:].zero_()
        self.tables[m:n + 1].zero_()
        seqs = [seq for seq, rows in plan for _ in range(rows)]
        logits, aux = self._replay(n)
        return logits[:lay.rows], seqs, _kept(aux, lay.rows)

    def _step(self, n: int, aux_layers):
        # views by narrow / unbind (what [...] gives, but these also run on fake CUDA tensors in a CPU-only torch:
        # tests/test_no_host_sync.py runs this body under FakeTensorMode)
        t = self.num_rows(n)
        ids, positions, slots = (x.narrow(0, 0, t) for x in self.tokens.unbind(0))
        qsl, lens = self.layout_buf.unbind(0)
        meta = AttentionMetadata(slot_mapping=slots, block_tables=self.tables.narrow(0, 0, n + 1),
                                 query_start_loc=qsl.narrow(0, 0, n + 2), seq_lens=lens.narrow(0, 0, n + 1))
        if aux_layers is None:
            return self.runner.step_logits(ids, positions, meta), None
        return self.runner.step_logits_aux(ids, positions, meta, aux_layers)
