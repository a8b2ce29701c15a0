"""Speculative decoding against the same engine without it, interleaved in the same minutes.

    python -m bench.spec [--checkpoint DIR] [--k 4] [--tokens 128] [--rounds 4] [--threads 2] [--floor]

Two engines of one configuration in one process, one with `speculative_config` (n-gram, k drafts), run
alternately (A B B A ...) on three workloads: batch 1 on a repeating workload (prompts whose continuation
repeats its context: with the demo's random weights, the loops greedy text falls into), batch 1 on random
token-id prompts, and batch 16 on random prompts. Reported per workload: output tokens/s of each, their
ratio (median over rounds), the acceptance (accepted / drafted tokens), the mean tokens per verification,
the engine steps each needed (steps off / on: what speculation saves whatever the host's load), and
whether every request's ids were identical (they must be). --floor: the STREAM read of the same threads
and the bytes per token, so the batch-1 figures can be set against the bandwidth floor. On a shared host
only the same-minute ratios mean anything. Without --checkpoint a tiny A8W8 demo checkpoint is built.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

REPEATING = ["a b a b a b a b a b a b", "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3", "Hello, world!", "介绍一下北京故宫"]


def build_engines(checkpoint: str, k: int, threads: int | None):
    from backend_lib.config import EngineConfig
    from backend_lib.engine import LLMEngine

    base = dict(checkpoint=checkpoint, kv_cache_memory="512MiB", max_model_len=2048, max_num_seqs=16,
                max_num_batched_tokens=512, enable_prefix_caching=False, num_threads=threads)
    off = LLMEngine(EngineConfig(**base))
    on = LLMEngine(EngineConfig(**base, speculative_config=json.dumps(
        {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4})))
    return off, on


def run_once(engine, prompts, tokens):
    params = engine.make_params({"temperature": 0, "max_tokens": tokens, "ignore_eos": True})
    steps = engine.runner.steps
    t0 = time.perf_counter()
    res = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    return [r["output_ids"] for r in res], sum(len(r["output_ids"]) for r in res) / dt, engine.runner.steps - steps


def workload(name, off, on, prompts, tokens, rounds):
    rows = {"workload": name, "batch": len(prompts), "identical": True, "ratios": []}
    run_once(off, prompts, 8)   # warm both
    run_once(on, prompts, 8)
    before = on.stats
    tps_off, tps_on = [], []
    steps = {True: 0, False: 0}
    for r in range(rounds):
        order = [(off, tps_off), (on, tps_on)] if r % 2 == 0 else [(on, tps_on), (off, tps_off)]
        ids = {}
        for eng, acc in order:
            out, tps, n = run_once(eng, prompts, tokens)
            acc.append(tps)
            ids[eng is on] = out
            steps[eng is on] += n
        rows["identical"] &= ids[True] == ids[False]
        rows["ratios"].append(tps_on[-1] / tps_off[-1])
    s = on.stats
    drafted = s.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = s.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    drafts = s.spec_num_drafts - before.spec_num_drafts
    rows.update(tps_off=statistics.median(tps_off), tps_on=statistics.median(tps_on),
                ratio=statistics.median(rows["ratios"]), acceptance=accepted / drafted if drafted else 0.0,
                tokens_per_verification=1 + accepted / drafts if drafts else 1.0, drafts=drafts,
                step_ratio=steps[False] / steps[True])
    return rows


def weight_mb(engine) -> float:
    """Bytes read per decode token as bench.ab_builds counts them (the prepared weights of every linear)."""
    import torch

    return sum(t.numel() * t.element_size() for m in engine.runner.model.modules()
               for t in (getattr(m, "prepared", None) or ()) if isinstance(t, torch.Tensor)) / 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--random-length", type=int, default=64)
    ap.add_argument("--floor", action="store_true", help="also measure the STREAM read (batch-1 floor)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    ckpt = args.checkpoint
    if ckpt is None:
        from backend_lib.tools.make_demo_checkpoint import build

        ckpt = str(build(tempfile.mkdtemp(prefix="bench-spec-") + "/tiny-a8w8", "tiny", "a8w8", 0))
    from bench.workers.common import prompts as random_prompts

    off, on = build_engines(ckpt, args.k, args.threads)
    results = []
    for i, text in enumerate(REPEATING[:2]):
        results.append(workload(f"repeating-{i}", off, on, [off.tokenizer.encode(text)], args.tokens, args.rounds))
    results.append(workload("random", off, on, random_prompts(1, args.random_length, seed=1), args.tokens,
                            args.rounds))
    results.append(workload("random-b16", off, on, random_prompts(16, args.random_length, seed=2), args.tokens,
                            max(2, args.rounds // 2)))
    floor = None
    if args.floor:
        import torch

        from bench.step_profile import stream_read_gbs

        gbs = stream_read_gbs(args.threads or torch.get_num_threads())
        floor = {"stream_gbs": gbs, "weight_mb": weight_mb(off), "floor_tps": gbs * 1e3 / weight_mb(off)}
    if args.json:
        print(json.dumps({"results": results, "floor": floor}))
        return 0
    print("shared host: only the same-minute ratios mean anything")
    print(f"{'workload':<14} {'batch':>5} {'off tok/s':>10} {'on tok/s':>10} {'ratio':>6} {'accept':>7} "
          f"{'tok/verif':>9} {'steps off/on':>12} {'identical':>9}")
    for r in results:
        print(f"{r['workload']:<14} {r['batch']:>5} {r['tps_off']:>10.1f} {r['tps_on']:>10.1f} {r['ratio']:>6.2f} "
              f"{r['acceptance']:>7.2f} {r['tokens_per_verification']:>9.2f} {r['step_ratio']:>12.2f} "
              f"{str(r['identical']):>9}")
    if floor:
        print(f"STREAM {floor['stream_gbs']:.1f} GB/s, weights {floor['weight_mb']:.1f} MB/token: floor "
              f"{floor['floor_tps']:.1f} tokens/s at batch 1")
    return 0 if all(r["identical"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
