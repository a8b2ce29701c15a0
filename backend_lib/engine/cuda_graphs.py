"""Decode steps replayed from CUDA graphs: one graph per batch bucket (1, 2, 4, ..., >= max_num_seqs), captured
at the bucket's first use over static input buffers, then replayed with the step's ids, block tables and cached
lengths copied in. Rows past the step's batch are padding (cached length -1: no KV write, their logits
dropped); the kernels are batch invariant, so a padded step gives the real rows the same bits as an unpadded
one. Prefill stays eager.

Used with the Triton kernel set on CUDA (`cuda_graphs`, default on). `capture=False` runs the same padded
buffers eagerly: how the CPU tests prove the padding (the capture itself has not run on a GPU yet).
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def buckets(max_num_seqs: int) -> list[int]:
    out = [1]
    while out[-1] < max_num_seqs:
        out.append(out[-1] * 2)
    return out


class DecodeGraphs:
    def __init__(self, runner, max_num_seqs: int, max_pages: int, capture: bool = True):
        self.runner, self.capture = runner, capture
        self.buckets = buckets(max_num_seqs)
        n, dev = self.buckets[-1], runner.device
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.tables = torch.zeros((n, max_pages), dtype=torch.int32, device=dev)
        self.context = torch.full((n,), -1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple] = {}
        self.failed = False

    def fits(self, batch: int, width: int) -> bool:
        return not self.failed and batch <= self.buckets[-1] and width <= self.tables.shape[1]

    def run(self, ids: torch.Tensor, tables: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """fp32 logits [B, vocab] of a decode step (device tensors in, as ModelRunner.decode_inputs gives)."""
        b, w = tables.shape
        n = next(k for k in self.buckets if k >= b)
        self.ids[:b].copy_(ids)
        self.tables[:b, :w].copy_(tables)
        self.tables[:b, w:].zero_()
        self.context[:b].copy_(context)
        self.context[b:n].fill_(-1)
        if not self.capture:
            return self._step(n)[:b]
        if n not in self.graphs:
            try:
                self.graphs[n] = self._capture(n)
            except RuntimeError as exc:     # never a broken engine for want of a graph: eager from here on
                log.warning("CUDA graph capture of the batch-%d decode failed (%s); decoding eagerly", n, exc)
                self.failed = True
                return self._step(n)[:b]
        graph, out = self.graphs[n]
        graph.replay()
        return out[:b]

    def _step(self, n: int) -> torch.Tensor:
        return self.runner.decode_logits(self.ids[:n], self.tables[:n], self.context[:n])

    def _capture(self, n: int):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):      # warm-up: Triton compiles its variants, the allocator settles
            self._step(n)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._step(n)
        log.info("captured the batch-%d decode step as a CUDA graph", n)
        return graph, out
