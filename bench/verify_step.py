"""Verification-shaped steps of the C++ layer loop: the one parallel region against the op-by-op path.

    python -m bench.verify_step --checkpoint DIR [--threads 2] [--rounds 5] [--steps 8] [--context 128] [--aux]

Hand-built steps (every sequence `context` tokens cached, then 1 or k + 1 = 5 new rows: [1], [5], [1, 5, 1, 5],
[5, 5, 5, 5]) through Qwen3ForCausalLM.forward with the C++ layer loop, timed two ways in alternation: as the
engine passes them (query_start_loc int32: csrc/decode_layers.cpp's one region) and with query_start_loc int64,
which the region refuses (its checks) while the ops convert it, so the same step runs the ops one by one (each
its own parallel region), the same bits. Per shape: the best of `rounds` medians of `steps` forwards, and how
many forwards ran in the region (decode_layers_profile). Only same-minute comparisons mean anything on a shared
host.

--aux ([spec] EAGLE-3): the same steps through Qwen3ForCausalLM.forward_aux (the aux states of layers 2, L / 2,
L - 3, vLLM's default) in the C++ loop (the region writes them) against the Python layer loop (use_layer_loop off:
where EAGLE-3 steps ran before the region wrote aux states).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPES = ([1], [5], [1, 5, 1, 5], [5, 5, 5, 5])


def _engine(ckpt: str):
    from backend_lib.config import EngineConfig
    from backend_lib.engine import LLMEngine
    return LLMEngine(EngineConfig(checkpoint=ckpt, dtype="bfloat16", page_size=16, kv_cache_memory="256MiB",
                                  max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=64))


def _step(page_size: int, rows: list[int], cached: int):
    """(input_ids, positions, metadata, the metadata with int64 query_start_loc): sequence i on pages of its own."""
    from backend_lib.kv_cache.metadata import AttentionMetadata
    S = page_size
    need = [-(-(cached + r) // S) for r in rows]
    tables, at = [], 1
    for n in need:
        tables.append(list(range(at, at + n)) + [0] * (max(need) - n))
        at += n
    pos = [cached + j for r in rows for j in range(r)]
    seq = [i for i, r in enumerate(rows) for _ in range(r)]
    qsl = [0]
    for r in rows:
        qsl.append(qsl[-1] + r)
    meta = AttentionMetadata(slot_mapping=torch.tensor([tables[i][p // S] * S + p % S for i, p in zip(seq, pos)]),
                             block_tables=torch.tensor(tables, dtype=torch.int32),
                             query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                             seq_lens=torch.tensor([cached + r for r in rows], dtype=torch.int32))
    ops = AttentionMetadata(meta.slot_mapping, meta.block_tables, meta.query_start_loc.long(), meta.seq_lens)
    return torch.randint(0, 1000, (sum(rows),)), torch.tensor(pos), meta, ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--aux", action="store_true",
                    help="forward_aux (EAGLE-3's aux states) in the C++ loop against the Python layer loop")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    eng = _engine(args.checkpoint)
    model, kv = eng.runner.model, eng.runner.kv_cache
    if not model.layer_loop.applies(kv):
        raise SystemExit("the C++ layer loop does not apply to this checkpoint (A8W8, W4A16 or float weights, cpu kernels, dense cache)")

    L = len(model.layers)
    aux_layers = (2, L // 2, L - 3)

    def forward(ids, pos, meta, python=False):
        if not args.aux:
            return model.forward(ids, pos, kv, meta)
        model.use_layer_loop = not python
        try:
            return model.forward_aux(ids, pos, kv, meta, aux_layers)
        finally:
            model.use_layer_loop = True

    def timed(ids, pos, meta, python=False):
        forward(ids, pos, meta, python)
        ts = []
        for _ in range(args.steps):
            t = time.perf_counter()
            forward(ids, pos, meta, python)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1e3

    other = "Python loop (forward_aux)" if args.aux else "ops one by one"
    first = f"one region{' (forward_aux)' if args.aux else ''}"
    print(f"| rows per sequence | {first}, ms | {other}, ms | forwards in the region |  ({args.threads} "
          f"threads, {args.context} tokens cached)\n|---|---|---|---|")
    for rows in SHAPES:
        ids, pos, meta, ops = _step(kv.page_size, rows, args.context)
        torch.ops.qwen3_cpu.decode_layers_profile(True)
        region, op_by_op = [], []
        for _ in range(args.rounds):   # alternated
            region.append(timed(ids, pos, meta))
            op_by_op.append(timed(ids, pos, meta, python=True) if args.aux else timed(ids, pos, ops))
        n = int(torch.ops.qwen3_cpu.decode_layers_profile(False)[0, -1].item())
        print(f"| {rows} | {min(region):.2f} | {min(op_by_op):.2f} | {n} of {2 * args.rounds * (args.steps + 1)} |",
              flush=True)


if __name__ == "__main__":
    main()
