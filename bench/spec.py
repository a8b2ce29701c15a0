"""Speculative decoding against the same engine without it, interleaved in the same minutes.

    python -m bench.spec [--checkpoint DIR] [--k 4] [--tokens 128] [--rounds 4] [--threads 2] [--floor]
                         [--draft DIR]

Two engines of one configuration in one process, one with `speculative_config` (n-gram, k drafts), run
alternately (A B B A ...) on three workloads: batch 1 on a repeating workload (prompts whose continuation
repeats its context: with the demo's random weights, the loops greedy text falls into), batch 1 on random
token-id prompts, and batch 16 on random prompts. Reported per workload: output tokens/s of each, their
ratio (median over rounds), the acceptance (accepted / drafted tokens), the mean tokens per verification,
the engine steps each needed (steps off / on: what speculation saves whatever the host's load), and
whether every request's ids were identical (they must be). --floor: the STREAM read of the same threads
and the bytes per token, so the batch-1 figures can be set against the bandwidth floor. On a shared host
only the same-minute ratios mean anything. Without --checkpoint a tiny A8W8 demo checkpoint is built.

--draft DIR: the speculating engine drafts with that checkpoint (method draft_model) instead of n-grams, and
the run also measures what the draft costs (batch 1, greedy, the first repeating prompt), in units of one plain
decode step of the target (T1, the off engine's mean forward + sampling per step):
  c  = the draft's time per speculating step (its catch-up forward and k - 1 decode forwards) / T1
  v  = the rest of that step: the target's verification (k + 1 positions, sampling, the acceptance walk) / T1
  (medians over steps: T1 over the plain engine's decode steps, c and v over the steps that verified drafts)
  cost per verified position = (c + v) / (k + 1)
  break-even: speculation pays when the mean tokens per verification E = 1 + accepted drafts exceeds
  E* = c + v; with a per-position acceptance a (independent), E = (1 - a^(k+1)) / (1 - a), so the break-even
  acceptance a* solves (1 - a*^(k+1)) / (1 - a*) = c + v (bisection; a* > 1 when even full acceptance loses).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

REPEATING = ["a b a b a b a b a b a b", "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3", "Hello, world!", "介绍一下北京故宫"]


def build_engines(checkpoint: str, k: int, threads: int | None, draft: str | None = None, **spec_keys):
    from backend_lib.config import EngineConfig
    from backend_lib.engine import LLMEngine

    base = dict(checkpoint=checkpoint, kv_cache_memory="512MiB", max_model_len=2048, max_num_seqs=16,
                max_num_batched_tokens=512, enable_prefix_caching=False, num_threads=threads)
    off = LLMEngine(EngineConfig(**base))
    spec = ({"method": "draft_model", "model": draft, "num_speculative_tokens": k} if draft else
            {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    spec.update(spec_keys)
    on = LLMEngine(EngineConfig(**base, speculative_config=json.dumps(spec)))
    return off, on


def break_even_acceptance(e_star: float, k: int) -> float:
    """The per-position acceptance a at which (1 - a^(k+1)) / (1 - a) = e_star (inf past k + 1)."""
    if e_star <= 1:
        return 0.0
    if e_star >= k + 1:
        return float("inf")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if sum(a ** i for i in range(k + 1)) < e_star:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2


class _StepTimes:
    """Per engine step of a run: its wall time and the time its proposer took, and whether it verified drafts
    (instance attribute wraps of engine.step and the proposer's propose; unwrap() restores them)."""

    def __init__(self, engine):
        self.engine, self.steps, self._propose = engine, [], 0.0
        step, spec = engine.step, engine.spec
        prop = spec.proposer if spec is not None else None
        if prop is not None:
            real_propose = prop.propose

            def propose(rows):
                t0 = time.perf_counter()
                try:
                    return real_propose(rows)
                finally:
                    self._propose += time.perf_counter() - t0
            prop.propose = propose

        def timed():
            before = engine.stats.spec_num_drafts
            self._propose = 0.0
            t0 = time.perf_counter()
            out = step()
            self.steps.append((time.perf_counter() - t0, self._propose, engine.stats.spec_num_drafts > before))
            return out
        engine.step = timed

    def unwrap(self):
        del self.engine.step
        if self.engine.spec is not None and "propose" in vars(self.engine.spec.proposer):
            del self.engine.spec.proposer.propose


def draft_cost(off, on, prompt, tokens: int, rounds: int, k: int) -> dict:
    """c, v, the cost per verified position and the break-even acceptance (module doc), interleaved rounds: T1
    over the off engine's decode steps (its first, the prefill, left out), c and v over the on engine's steps
    that verified drafts (steps of paused drafts left out)."""
    run_once(off, [prompt], 8)
    run_once(on, [prompt], 8)
    t1, c, v, e, acc = [], [], [], [], []
    for r in range(rounds):
        for eng in ((off, on) if r % 2 == 0 else (on, off)):
            before = eng.stats
            times = _StepTimes(eng)
            run_once(eng, [prompt], tokens)
            times.unwrap()
            if eng is off:
                t1 += [dt for dt, _, _ in times.steps[1:]]
                continue
            spec = [(dt, p) for dt, p, verified in times.steps if verified]
            c += [p for _, p in spec]
            v += [dt - p for dt, p in spec]
            s = eng.stats
            drafts = s.spec_num_drafts - before.spec_num_drafts
            accepted = s.spec_num_accepted_tokens - before.spec_num_accepted_tokens
            drafted = s.spec_num_draft_tokens - before.spec_num_draft_tokens
            e.append(1 + accepted / drafts if drafts else 1.0)
            acc.append(accepted / drafted if drafted else 0.0)
    if not c:
        raise SystemExit("the draft engine verified no drafts: no cost to measure")
    T1, C, V = statistics.median(t1), statistics.median(c), statistics.median(v)
    return {"t1_ms": T1 * 1e3, "draft_ms": C * 1e3, "verify_ms": V * 1e3, "c": C / T1, "v": V / T1,
            "cost_per_position": (C + V) / T1 / (k + 1), "break_even_tokens": (C + V) / T1,
            "break_even_acceptance": break_even_acceptance((C + V) / T1, k),
            "tokens_per_verification": statistics.median(e), "acceptance": statistics.median(acc), "k": k,
            "steps_timed": (len(t1), len(c))}


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
    """Bytes read per decode token as bench.ab_builds counts them (step_profile.decode_weight_mb)."""
    from bench.step_profile import decode_weight_mb

    return decode_weight_mb(engine.runner.model)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--random-length", type=int, default=64)
    ap.add_argument("--floor", action="store_true", help="also measure the STREAM read (batch-1 floor)")
    ap.add_argument("--draft", help="a draft checkpoint: method draft_model, and its cost measured")
    ap.add_argument("--cost-only", action="store_true",
                    help="with --draft: only the draft's cost (no workloads; no auto-disable: every step drafts)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.cost_only and not args.draft:
        ap.error("--cost-only measures a draft model's cost: it needs --draft")
    ckpt = args.checkpoint
    if ckpt is None:
        from backend_lib.tools.make_demo_checkpoint import build

        ckpt = str(build(tempfile.mkdtemp(prefix="bench-spec-") + "/tiny-a8w8", "tiny", "a8w8", 0))
    from bench.workers.common import prompts as random_prompts

    # --cost-only: every step drafts (no auto-disable), so every step of the draft engine is timed
    off, on = build_engines(ckpt, args.k, args.threads, args.draft,
                            **({"min_acceptance": 0.0} if args.cost_only else {}))
    results = []
    for i, text in enumerate(REPEATING[:2] if not args.cost_only else ()):
        results.append(workload(f"repeating-{i}", off, on, [off.tokenizer.encode(text)], args.tokens, args.rounds))
    if not args.cost_only:
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
    cost = None
    if args.draft:
        cost = draft_cost(off, on, off.tokenizer.encode(REPEATING[0]), args.tokens, max(2, args.rounds), args.k)
    if args.json:
        print(json.dumps({"results": results, "floor": floor, "draft_cost": cost}))
        return 0
    print("shared host: only the same-minute ratios mean anything")
    if results:
        print(f"{'workload':<14} {'batch':>5} {'off tok/s':>10} {'on tok/s':>10} {'ratio':>6} {'accept':>7} "
              f"{'tok/verif':>9} {'steps off/on':>12} {'identical':>9}")
    for r in results:
        print(f"{r['workload']:<14} {r['batch']:>5} {r['tps_off']:>10.1f} {r['tps_on']:>10.1f} {r['ratio']:>6.2f} "
              f"{r['acceptance']:>7.2f} {r['tokens_per_verification']:>9.2f} {r['step_ratio']:>12.2f} "
              f"{str(r['identical']):>9}")
    if floor:
        print(f"STREAM {floor['stream_gbs']:.1f} GB/s, weights {floor['weight_mb']:.1f} MB/token: floor "
              f"{floor['floor_tps']:.1f} tokens/s at batch 1")
    if cost:
        print(f"draft {args.draft}, k = {cost['k']}: plain decode step T1 {cost['t1_ms']:.2f} ms; per speculating "
              f"step the draft {cost['draft_ms']:.2f} ms (c = {cost['c']:.3f} T1), the verification "
              f"{cost['verify_ms']:.2f} ms (v = {cost['v']:.3f} T1)")
        print(f"cost per verified position (c + v) / (k + 1) = {cost['cost_per_position']:.3f} T1; break-even "
              f"E* = c + v = {cost['break_even_tokens']:.2f} tokens per verification, per-position acceptance "
              f"a* = {cost['break_even_acceptance']:.3f}; measured here E = {cost['tokens_per_verification']:.2f}, "
              f"acceptance {cost['acceptance']:.2f}")
    return 0 if all(r["identical"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
