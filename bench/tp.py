"""Tensor parallel on this host: TP = 2 (two rank processes, one thread each) against TP = 1 (one process, two
threads), decode steps at batch 1 and 16 on the same checkpoint, alternated round by round; and the share of a
TP = 2 step spent in its collectives (the row-parallel layers' all-reduces, the vocab-parallel embedding's and
logits' gathers, timed on rank 0) and in sending the step's input message. A step is the forward and the logits
of its rows; TP = 2 runs the serving path (rank 0 sends each step over the step channel, the workers run
runtime.worker_loop), each rank bound to its own core (--no-bind: not).

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


def _step_ms(model, cache, batch: int, context: int, steps: int, page: int, spent: dict) -> float:
    """ms per decode step (the forward and the logits of its rows) after two warm-up steps; spent's counters (the
    collectives' and the input message's seconds) count from there."""
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
                spent.update(collective=0.0, input=0.0)
            ctx = torch.full((batch,), context + s, dtype=torch.int32)
            meta, positions = AttentionMetadata.for_decode(tables, ctx, page)
            model.logits(model(torch.randint(0, 1000, (batch,), generator=g), positions, cache, meta))
    return (time.perf_counter() - t0) / steps * 1e3


def _timed(obj, names, spent: dict, key: str) -> None:
    """Wraps obj's methods to add their seconds to spent[key] (outermost calls only: no double count)."""
    depth = [0]
    for name in names:
        orig = getattr(obj, name)

        def timed(*a, _orig=orig, **kw):
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return _orig(*a, **kw)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    spent[key] = spent.get(key, 0.0) + time.perf_counter() - t0
        setattr(obj, name, timed)


def _collectives(args) -> dict | None:
    """--collectives: the cost c of one collective between two ranks with no compute between them (the software
    and wire floor; a step's c adds the ranks' imbalance at each barrier): MAX of [1, 1] fp32 and SUM of
    [1, hidden] int32 (a batch-1 row-parallel layer's two), and a step's input message."""
    from backend_lib.parallel import TPGroup
    from backend_lib.parallel.channel import StepChannel

    group = TPGroup.from_env("cpu")
    if not args.no_bind:
        from backend_lib.parallel.bind import bind_rank

        bind_rank((group.rank, group.size), None, 1)
    if not args.no_shm:
        group.enable_shm(f"qwen3-tp-{os.environ['MASTER_PORT']}", 1 << 20)
    from backend_lib.parallel import runtime

    ch = StepChannel(group, runtime._groups(group))
    n = args.steps * 50
    amax, acc = torch.ones(1, 1), torch.ones(1, 1024, dtype=torch.int32)
    step = [torch.ones(1, dtype=torch.int64)] * 3 + [torch.ones(1, 64, dtype=torch.int32)] + \
        [torch.ones(2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)]
    out = {}
    for name, fn in (("max_us", lambda: group.all_reduce_max_(amax)), ("sum_us", lambda: group.all_reduce_sum_(acc)),
                     ("input_us", lambda: ch.send(1, tensors=step) if group.rank == 0 else ch.recv())):
        for _ in range(20):
            fn()
        group.all_reduce_max_(amax)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        group.all_reduce_max_(amax)
        out[name] = (time.perf_counter() - t0) / n * 1e6
    group.destroy()
    return out if group.rank == 0 else None


def _rank(args) -> dict | None:
    from backend_lib.checkpoint import ModelConfig
    from backend_lib.device import parse_dtype
    from backend_lib.kernels import get_kernels
    from backend_lib.kv_cache import allocate_kv_cache
    from backend_lib.parallel import TPGroup
    from backend_lib.parallel.model import load_model

    dev = torch.device("cpu")
    group = TPGroup.from_env(dev) if args.tp > 1 else TPGroup()
    bound = None
    if group.size > 1 and not args.no_bind:      # each rank on its own cores (parallel/bind.py)
        from backend_lib.parallel.bind import bind_rank

        bound = bind_rank((group.rank, group.size), None, args.threads)
    if bound is None:
        torch.set_num_threads(args.threads)
    mc = ModelConfig.from_dir(args.checkpoint)
    if group.size > 1 and not args.no_shm:   # every rank on this host (launch): collectives in shared memory
        from backend_lib.parallel.group import shm_slot_bytes
        from backend_lib.parallel.vocab import vocab_share

        group.enable_shm(f"qwen3-tp-{os.environ['MASTER_PORT']}",
                         shm_slot_bytes(args.context * max(args.batches), mc.hidden_size,
                                        logits_rows=max(args.batches), vocab_share=vocab_share(mc.vocab_size,
                                                                                               group.size)))
    dtype = parse_dtype("bfloat16", dev)
    kernels = get_kernels(dev, "auto")
    max_len = args.context + args.steps + 8
    model = load_model(args.checkpoint, dtype, kernels, max_len, group)
    cache = allocate_kv_cache("bf16", model.cfg, dtype, dev, kernels, "1GiB", 16, max_len, max(args.batches))
    spent: dict = {}
    if group.size > 1:   # the serving path: rank 0 sends each step's message, the workers run worker_loop
        from backend_lib.parallel import runtime
        from backend_lib.parallel.channel import StepChannel

        ch = StepChannel(group, runtime._groups(group))
        if group.rank != 0:
            runtime.worker_loop(model, cache, ch)
            group.destroy()
            return None
        _timed(group, ("all_reduce_max_", "all_reduce_sum_", "sum_in_rank_order", "all_gather", "gather_to_0"),
               spent, "collective")
        _timed(ch, ("send",), spent, "input")
        model = runtime.ShardedModel(model, ch, runtime.Supervisor([]))
    out = {}
    for batch in args.batches:
        for loop in ([False, True] if group.size == 1 else [False]):
            model.use_layer_loop = loop
            ms = _step_ms(model, cache, batch, args.context, args.steps, 16, spent)
            key = f"{batch}{'-region' if loop else ''}"
            out[key] = {"ms": ms, "collective_ms": spent.get("collective", 0.0) / args.steps * 1e3,
                        "input_ms": spent.get("input", 0.0) / args.steps * 1e3}
    if group.size > 1:
        ch.send(runtime.STOP)
    group.destroy()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="TP = 1's threads; each TP = 2 rank gets threads / 2")
    ap.add_argument("--tp", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--no-shm", action="store_true", help="collectives through gloo only (no shared memory)")
    ap.add_argument("--no-bind", action="store_true", help="TP = 2 ranks not bound to their cores")
    ap.add_argument("--collectives", action="store_true",
                    help="only the cost of one collective between two ranks (no model; --checkpoint unused)")
    ap.add_argument("--rank-process", action="store_true", help=argparse.SUPPRESS)
    raw = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(raw)
    args.batches = [int(b) for b in str(args.batches).split(",")]
    if not args.checkpoint and not args.collectives:
        ap.error("--checkpoint is required (except with --collectives)")
    if args.tp:
        res = _collectives(args) if args.collectives else _rank(args)
        if res is not None:
            print(json.dumps(res), flush=True)
        return
    from backend_lib.parallel.check import launch

    if args.collectives:
        base = ["--checkpoint", args.checkpoint, "--steps", str(args.steps), *(["--no-shm"] if args.no_shm else []),
                *(["--no-bind"] if args.no_bind else []), "--collectives"]
        for r in range(args.rounds):
            print(json.dumps({"round": r, **json.loads(launch([*base, "--tp", "2"], 2, module="bench.tp")
                                                      .strip().splitlines()[-1])}), flush=True)
        return

    base = ["--checkpoint", args.checkpoint, "--batches", ",".join(map(str, args.batches)), "--steps",
            str(args.steps), "--context", str(args.context), *(["--no-shm"] if args.no_shm else []),
            *(["--no-bind"] if args.no_bind else [])]
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
          "| TP = 2 collectives share | TP = 2 input message share |")
    print("|---|---|---|---|---|---|---|")
    for b in args.batches:
        one, reg, two = best[f"tp1-{b}"], best[f"tp1-{b}-region"], best[f"tp2-{b}"]
        print(f"| {b} | {reg['ms']:.2f} | {one['ms']:.2f} | {two['ms']:.2f} | {one['ms'] / two['ms']:.2f}x "
              f"| {two['collective_ms'] / two['ms']:.0%} | {two['input_ms'] / two['ms']:.0%} |")


if __name__ == "__main__":
    main()
