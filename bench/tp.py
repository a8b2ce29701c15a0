"""Tensor parallel on this host: TP = 2 (two rank processes, one thread each) against TP = 1 (one process, two
threads), decode steps at batch 1 and 16 on the same checkpoint, alternated round by round; and the share of a
TP = 2 step spent in its collectives (the all-reduces of the row-parallel layers, timed on rank 0).

    python -m bench.tp --checkpoint DIR [--batches 1,16] [--steps 32] [--context 128] [--rounds 3] [--threads 2]

Prints one JSON line per measurement and a table: ms per decode step, tokens/s, TP = 2 / TP = 1, collective
share. TP = 1 runs the per-layer path, as TP = 2 must (the one-region loop is TP = 1 only): the ratio is the
sharding's, not the region's; the region's own step is shown beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def _step_ms(model, cache, batch: int, context: int, steps: int, page: int, spent: list) -> float:
    """ms per decode step after two warm-up steps; spent[0] (the collectives' seconds) counts from there."""
    from backend_lib.kv_cache.metadata import AttentionMetadata

    pages = -(-(context + steps + 1) // page)
    tables = torch.arange(batch * pages, dtype=torch.int32).reshape(batch, pages)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (batch * context,), generator=g)
    pos = torch.arange(context).repeat(batch)
    slots = torch.cat([tables[b, :].repeat_interleave(page)[:context].long() * page + torch.arange(context) % page
                       for b in range(batch)])
    qsl = torch.arange(batch + 1, dtype=torch.int32) * context
    with torch.inference_mode():
        model(ids, pos, cache, AttentionMetadata(slots, tables, qsl, torch.full((batch,), context, dtype=torch.int32)))
        t0 = None
        for s in range(steps + 2):
            if s == 2:
                t0 = time.perf_counter()
                spent[0] = 0.0
            ctx = torch.full((batch,), context + s, dtype=torch.int32)
            meta, positions = AttentionMetadata.for_decode(tables, ctx, page)
            model(torch.randint(0, 1000, (batch,), generator=g), positions, cache, meta)
    return (time.perf_counter() - t0) / steps * 1e3


def _rank(args) -> dict | None:
    from backend_lib.device import parse_dtype
    from backend_lib.kernels import get_kernels
    from backend_lib.kv_cache import allocate_kv_cache
    from backend_lib.parallel import TPGroup
    from backend_lib.parallel.model import load_model

    torch.set_num_threads(args.threads)
    dev = torch.device("cpu")
    group = TPGroup.from_env(dev) if args.tp > 1 else TPGroup()
    if group.size > 1 and not args.no_shm:   # every rank on this host (launch): collectives in shared memory
        from backend_lib.checkpoint import ModelConfig
        from backend_lib.parallel.group import shm_slot_bytes

        group.enable_shm(f"qwen3-tp-{os.environ['MASTER_PORT']}",
                         shm_slot_bytes(args.context * max(args.batches),
                                        ModelConfig.from_dir(args.checkpoint).hidden_size))
    dtype = parse_dtype("bfloat16", dev)
    kernels = get_kernels(dev, "auto")
    max_len = args.context + args.steps + 8
    model = load_model(args.checkpoint, dtype, kernels, max_len, group)
    spent = [0.0]
    for name in ("all_reduce_max_", "all_reduce_sum_", "sum_in_rank_order"):   # time rank 0's collectives
        orig = getattr(group, name)

        def timed(t, _orig=orig):
            t0 = time.perf_counter()
            out = _orig(t)
            spent[0] += time.perf_counter() - t0
            return out
        setattr(group, name, timed)
    out = {}
    for batch in args.batches:
        cache = allocate_kv_cache("bf16", model.cfg, dtype, dev, kernels, "1GiB", 16, max_len, batch)
        for loop in ([False, True] if group.size == 1 else [False]):
            model.use_layer_loop = loop
            ms = _step_ms(model, cache, batch, args.context, args.steps, 16, spent)
            key = f"{batch}{'-region' if loop else ''}"
            out[key] = {"ms": ms, "collective_ms": spent[0] / args.steps * 1e3 if group.size > 1 else 0.0}
    group.destroy()
    return out if group.rank == 0 else None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="TP = 1's threads; each TP = 2 rank gets threads / 2")
    ap.add_argument("--tp", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--no-shm", action="store_true", help="collectives through gloo only (no shared memory)")
    ap.add_argument("--rank-process", action="store_true", help=argparse.SUPPRESS)
    raw = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(raw)
    args.batches = [int(b) for b in str(args.batches).split(",")]
    if args.tp:
        res = _rank(args)
        if res is not None:
            print(json.dumps(res), flush=True)
        return
    from backend_lib.parallel.check import launch

    base = ["--checkpoint", args.checkpoint, "--batches", ",".join(map(str, args.batches)), "--steps",
            str(args.steps), "--context", str(args.context), *(["--no-shm"] if args.no_shm else [])]
    best: dict[str, dict] = {}
    for r in range(args.rounds):
        for tp in ((1, 2) if r % 2 == 0 else (2, 1)):
            if tp == 1:
                import subprocess
                line = subprocess.run([sys.executable, "-m", "bench.tp", *base, "--tp", "1", "--threads",
                                       str(args.threads)], capture_output=True, text=True, check=True).stdout
            else:
                line = launch([*base, "--tp", "2", "--threads", str(max(1, args.threads // 2))], 2, module="bench.tp")
            res = json.loads(line.strip().splitlines()[-1])
            print(json.dumps({"round": r, "tp": tp, **res}), flush=True)
            for key, v in res.items():
                k = f"tp{tp}-{key}"
                if k not in best or v["ms"] < best[k]["ms"]:
                    best[k] = v
    print("\n| batch | TP = 1 region ms | TP = 1 per-layer ms | TP = 2 ms | TP = 2 / TP = 1 per-layer (speed) "
          "| TP = 2 collectives share |")
    print("|---|---|---|---|---|---|")
    for b in args.batches:
        one, reg, two = best[f"tp1-{b}"], best[f"tp1-{b}-region"], best[f"tp2-{b}"]
        print(f"| {b} | {reg['ms']:.2f} | {one['ms']:.2f} | {two['ms']:.2f} | {one['ms'] / two['ms']:.2f}x "
              f"| {two['collective_ms'] / two['ms']:.0%} |")


if __name__ == "__main__":
    main()
