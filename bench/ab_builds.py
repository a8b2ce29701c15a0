"""Decode step time of two checkouts (or two environments) of this engine, interleaved in the same minutes.

    python -m bench.ab_builds --a /path/to/other/checkout [--b .] [--blocks 16] [--steps 16]
                              [--configs 2x1,1x1,2x16] [--context 128] [--a-env K=V,...] [--b-env K=V,...]
                              [--checkpoint DIR] [--lm-head-quant int4a8] [--config K=V,...] [--a-config K=V,...]
                              [--b-config K=V,...]

Each side is its own process (PYTHONPATH = its checkout, so each loads its own compiled kernels: the build cache is
keyed by the sources), loaded once with the same checkpoint. Per config (threads x batch), both start the same
batch of sequences, then `--blocks` blocks of `--steps` decode steps alternate A, B, B, A, ...; at batch 1 a
STREAM-style read (sum of 1 GiB, same thread count) follows every pair of blocks, and a block's bytes per token over
it is its floor (the weights and the KV rows its steps attend to: the sequences' context grows block by block, so the
KV part does too). Reported: each side's median and p10 step over all its steps, the A/B ratio of every pair's block
medians, and each pair's share of the floor. On a shared host only such same-minute ratios mean anything.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker(checkpoint: str, lm_head_quant: str = "checkpoint", extra: dict | None = None) -> None:
    """JSON lines on stdin: {"start": batch, "context": c, "threads": t} (prefill a batch, kept running),
    {"steps": n} (n decode steps; answers their times in ms), {"stop": 1}, {"stream": threads} (GB/s)."""
    import torch

    from backend_lib.config import EngineConfig
    from backend_lib.engine import LLMEngine
    from backend_lib.kv_cache import cache_class
    from bench.step_profile import decode_weight_mb, stream_read_gbs
    from bench.workers.common import prompts

    eng = LLMEngine(EngineConfig(checkpoint=checkpoint, kv_cache_memory="1GiB", max_model_len=4096, max_num_seqs=16,
                                 enable_prefix_caching=False, lm_head_quant=lm_head_quant, **(extra or {})))
    mb = decode_weight_mb(eng.runner.model)
    # KV bytes a position holds over all layers: step_profile.kv_bytes_per_token's formula, restated because the worker
    # imports the measured checkout's bench package, which may predate it
    mc = eng.model_config
    kv_per_token = cache_class(eng.cfg.kv_cache).bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, eng.dtype)
    print(json.dumps({"ready": True, "mb_per_token": mb}), flush=True)
    n = 0
    for line in sys.stdin:
        cmd = json.loads(line)
        if "stream" in cmd:
            out = {"gbs": stream_read_gbs(cmd["stream"])}
        elif "start" in cmd:
            torch.set_num_threads(cmd["threads"])
            b = cmd["start"]
            params = eng.make_params({"temperature": 0, "max_tokens": 3000, "ignore_eos": True})
            for i, p in enumerate(prompts(b, cmd["context"], seed=n)):
                eng.add_request(f"ab{n}_{i}", p, params)
            n += 1
            sch = eng.scheduler
            for _ in range(400):   # prefill until every sequence decodes, then two warm steps
                eng.step()
                if not sch.waiting and len(sch.running) == b and all(s.num_pending == 1 for s in sch.running):
                    break
            eng.step()
            eng.step()
            out = {"ok": True}
        elif "steps" in cmd:
            times, keys = [], []
            for _ in range(cmd["steps"]):
                keys.append(sum(seq.num_computed + 1 for seq in eng.scheduler.running))   # positions attended
                t0 = time.perf_counter()
                eng.step()
                times.append((time.perf_counter() - t0) * 1000)
            out = {"times": times, "kv_mb": kv_per_token * statistics.mean(keys) / 1e6}
        else:
            eng.abort_all()
            while eng.has_unfinished():
                eng.step()
            out = {"ok": True}
        print(json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="checkout of side A")
    ap.add_argument("--b", default=str(ROOT), help="checkout of side B (default: this one)")
    ap.add_argument("--a-env", default="", help="extra environment of side A: K=V,K=V")
    ap.add_argument("--b-env", default="")
    ap.add_argument("--checkpoint", default=str(ROOT / "demo_checkpoints" / "qwen3-0.6b-a8w8"))
    ap.add_argument("--lm-head-quant", default="checkpoint", help="both sides' EngineConfig.lm_head_quant "
                    "(checkpoint, int8, int4, int4a8)")
    ap.add_argument("--config", default="", help="both sides' other EngineConfig fields: K=V,K=V (strings, e.g. "
                    "moe_experts_quant=int4a8)")
    ap.add_argument("--a-config", default="", help="side A's EngineConfig fields besides (K=V,K=V): an A/B of a "
                    "setting within one checkout")
    ap.add_argument("--b-config", default="")
    ap.add_argument("--configs", default="2x1,1x1,2x16", help="threads x batch, comma separated")
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.checkpoint, args.lm_head_quant, dict(kv.split("=", 1) for kv in args.config.split(",") if kv))
        return
    sides = {}
    for name, root, extra, cfg in (("A", args.a, args.a_env, args.a_config), ("B", args.b, args.b_env, args.b_config)):
        env = dict(os.environ, PYTHONPATH=str(Path(root).resolve()))
        env.update(kv.split("=", 1) for kv in extra.split(",") if kv)
        # this file as the worker, whichever checkout it measures (the other may not have it): backend_lib and
        # bench.step_profile / bench.workers come from that checkout's PYTHONPATH
        sides[name] = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--a", "-", "--worker",
                                        "--checkpoint", args.checkpoint, "--lm-head-quant", args.lm_head_quant,
                                        "--config", ",".join(c for c in (args.config, cfg) if c)],
                                       cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                       bufsize=1)

    def read(name):
        while True:
            line = sides[name].stdout.readline()
            if not line:
                sys.exit(f"side {name} exited")
            if line.startswith("{"):
                return json.loads(line)

    def ask(name, msg):
        sides[name].stdin.write(json.dumps(msg) + "\n")
        return read(name)

    mb = {name: read(name)["mb_per_token"] for name in sides}
    print(f"A = {args.a} {args.a_env}; B = {args.b} {args.b_env}; weights read per token {mb['A']:.0f} / {mb['B']:.0f} MB; "
          f"started {time.strftime('%H:%M:%S')}, load average {os.getloadavg()[0]:.1f}")
    for cfg in args.configs.split(","):
        threads, batch = (int(v) for v in cfg.split("x"))
        for name in sides:
            ask(name, {"start": batch, "context": args.context, "threads": threads})
        steps = {"A": [], "B": []}
        cur, kv, ratios, shares, streams = {}, {}, [], [], []
        for k in range(args.blocks):
            name = "ABBA"[k % 4]
            block = ask(name, {"steps": args.steps})
            steps[name] += block["times"]
            cur[name] = statistics.median(block["times"])
            kv[name] = block["kv_mb"]
            if k % 2 == 1:
                ratios.append(cur["A"] / cur["B"])
                if batch == 1:   # the floor: the weights and the KV rows the block's steps read (their context grows)
                    streams.append(ask("A", {"stream": threads})["gbs"])
                    shares.append(tuple((mb[n] + kv[n]) / streams[-1] / cur[n] for n in ("A", "B")))
        for name in sides:
            ask(name, {"stop": 1})
        q = {n: sorted(v) for n, v in steps.items()}
        med = {n: v[len(v) // 2] for n, v in q.items()}
        p10 = {n: v[len(v) // 10] for n, v in q.items()}
        print(f"{threads} thread(s), batch {batch}: A median {med['A']:.2f} ms (p10 {p10['A']:.2f}; "
              f"{1000 * batch / med['A']:.1f} tokens/s), B median {med['B']:.2f} ms (p10 {p10['B']:.2f}; "
              f"{1000 * batch / med['B']:.1f} tokens/s); A/B per pair of blocks "
              + ", ".join(f"{r:.3f}" for r in ratios)
              + f" (median {statistics.median(ratios):.3f}, {sum(r > 1 for r in ratios)}/{len(ratios)} above 1)")
        if shares:
            print(f"  STREAM read after each pair: " + ", ".join(f"{g:.0f}" for g in streams) + " GB/s; share of the "
                  "floor (weights + KV) per pair, A / B: " + ", ".join(f"{a:.2f}/{b:.2f}" for a, b in shares)
                  + f" (medians {statistics.median(a for a, _ in shares):.2f} / "
                  f"{statistics.median(b for _, b in shares):.2f})")
    print(f"ended {time.strftime('%H:%M:%S')}, load average {os.getloadavg()[0]:.1f}")
    for p in sides.values():
        p.stdin.close()
        p.wait()


if __name__ == "__main__":
    main()
