"""Where a batch-1 decode step goes, per operation, at 1 and 2 threads (in-process, the compiled kernels).

    python -m bench.step_profile [--checkpoint DIR] [--threads 1,2] [--steps 64] [--context 128] [--layer-loop on,off]
    python -m bench.step_profile --region [--threads 1,2] [--rounds 5]     # the C++ loop's one region, per phase
    python -m bench.step_profile --region --batch 16 --checkpoint demo_checkpoints/qwen3-30b-a3b-l4-w4a16 \
        --lm-head-quant int4a8 --threads 2 --rounds 2                       # 16 sequences a step (time per phase)
    QWEN3_CPU_ISA=avx2 python -m bench.step_profile --region --threads 2   # the same for the AVX2 build of the kernels

One sequence with a `--context`-token prompt decodes `--steps` tokens twice per thread count: once as the
engine runs (the step time), once with every kernel call timed (each call is wrapped in a Python timer;
the difference between the two totals is the wrapper's own cost and is reported); `--rounds` rounds with
the thread counts alternated, and the table shows each count's fastest round (a shared host's neighbours
slow the others). Per operation: ms per
step, share of the step, and for the weight-streaming ones the GB/s they read. "Python and the rest" is
the step time minus every timed call: dispatch between the kernels (module calls, tensor views), the
scheduler, the input tensors, the output processor and detokenizer. A STREAM-style read (sum of 1 GiB)
at the same thread count gives the bandwidth floor of the step's bytes. The timed steps run the Python layer loop
(the C++ one, models/qwen3_layer_loop.py, makes one call of the layers); the untimed step time is measured with each
`--layer-loop` setting in turn within every round (an A/B alternated in the same minutes).
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from dataclasses import fields, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
LINEAR_OPS = ("a8w8_linear", "float_linear", "w4a16_linear", "w4a8_linear")


def decode_weight_mb(model) -> float:
    """MB of weights a plain-greedy batch-1 decode step reads: every linear's prepared weight, except that a
    screened greedy head (layers/greedy_head.py) reads its int8 screen (a module of its own, counted) and only its
    candidates' rows of the float weight (not counted: a few hundred KB), and a Qwen3-MoE layer only its top-k
    experts' weights (of its router's E)."""
    from backend_lib.layers.greedy_head import ScreenedHead
    from backend_lib.layers.moe import Qwen3SparseMoe

    total = sum(_prepared_bytes(m) for m in model.modules() if not isinstance(m, ScreenedHead))
    for layer in getattr(model, "layers", ()):
        if type(layer.mlp) is Qwen3SparseMoe:
            pairs = [p for p in layer.mlp.expert_pairs if p is not None]
            total -= sum(_prepared_bytes(m) for p in pairs for m in p)
            total += layer.mlp.top_k * sum(_prepared_bytes(m) for m in pairs[0])
    return total / 1e6


def stream_read_gbs(threads: int, gib: float = 1.0, repeats: int = 5, huge: bool = True) -> float:
    """Best of `repeats` sums over `gib` GiB of fp32 on `threads` threads: the read bandwidth the machine gives.

    With `huge` (the default) the buffer is on transparent huge pages as the engine's weights and KV pools are
    (the CPU set's stream_zeros, csrc/memory.cpp): on 4 KiB pages a virtual machine's read can be 1.2-1.5x slower,
    and a floor from that slower read would flatter the engine. huge=False: a plain torch tensor."""
    n = int(gib * 2**30) // 4
    x = None
    if huge:
        from backend_lib.kernels.cpu.build import load_cpu_extension

        if load_cpu_extension():
            x = torch.ops.qwen3_cpu.stream_zeros([n], torch.float32).fill_(1.0)
    if x is None:
        x = torch.ones(n, dtype=torch.float32)
    torch.set_num_threads(threads)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


class OpTimer:
    """Times every kernel call of a model (and the runner's prepare / sampler) by category."""

    def __init__(self, runner):
        self.runner = runner
        self.ns: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        model = runner.model
        self.labels: dict[int, tuple[str, int]] = {}   # id(prepared weight) -> (label, bytes read per call)
        for name, mod in model.named_modules():
            prepared = getattr(mod, "prepared", None)
            if prepared is not None:
                label = name.split(".")[-1] if name else "lm_head"
                tensors = prepared if isinstance(prepared, tuple) else (prepared,)
                nbytes = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
                self.labels[id(prepared)] = (label, nbytes)
        self.original = model.kernels
        self.holders = [m for m in model.modules() if hasattr(m, "kernels")] + [runner.kv_cache]
        self.orig_prepare, self.orig_sampler = runner.prepare, runner.sampler

    def _timed(self, label: str, fn, nbytes: int = 0):
        t0 = time.perf_counter_ns()
        out = fn()
        self.ns[label] += time.perf_counter_ns() - t0
        self.calls[label] += 1
        self.bytes[label] += nbytes
        return out

    def _wrap(self, op: str, fn):
        if op in LINEAR_OPS:
            def call(x, prepared, *a):
                label, nbytes = self.labels.get(id(prepared), (op, 0))
                return self._timed(f"GEMV {label}", lambda: fn(x, prepared, *a), nbytes)
            return call
        if op == "float_linear_rows":   # a screened head's candidates: one 64-byte line per k-pair of each row
            def rows(x, prepared, ids):
                label, _ = self.labels.get(id(prepared), ("float_linear", 0))
                lines = prepared[0].shape[1] if isinstance(prepared, tuple) else x.shape[-1]
                return self._timed(f"GEMV {label}: candidate rows", lambda: fn(x, prepared, ids), ids.numel() * lines * 64)
            return rows
        if op == "greedy_head_picks":   # a screened head's one call: its int8 screen, then its candidates' lines as above
            def head(x, screen, c, d, wmax, prepared, *a):
                label = "GEMV lm_head: screen and candidate rows (greedy_head_picks)"
                out = self._timed(label, lambda: fn(x, screen, c, d, wmax, prepared, *a),
                                  sum(t.numel() * t.element_size() for t in screen if isinstance(t, torch.Tensor)))
                self.bytes[label] += max(out[1], 0) * prepared[0].shape[1] * 64   # the union's lines, known after
                return out
            return head
        return lambda *a, **k: self._timed(op, lambda: fn(*a, **k))

    def install(self) -> None:
        k = self.original
        wrapped = replace(k, **{f.name: self._wrap(f.name, getattr(k, f.name))
                                for f in fields(k) if callable(getattr(k, f.name))})
        for m in self.holders:
            m.kernels = wrapped
        r = self.runner
        r.prepare = lambda plan: self._timed("step inputs (prepare)", lambda: self.orig_prepare(plan))
        sampler = self.orig_sampler
        r.sampler = lambda logits, seqs: self._timed("sampling", lambda: sampler(logits, seqs))

    def remove(self) -> None:
        for m in self.holders:
            m.kernels = self.original
        self.runner.prepare, self.runner.sampler = self.orig_prepare, self.orig_sampler


def decode_steps(eng, context: int, steps: int, seed: int, timer: "OpTimer | None" = None,
                 batch: int = 1) -> list[float]:
    """Step times (s) of `steps` decode steps of `batch` sequences after their `context`-token prefills; `timer`
    times the kernel calls of those steps only."""
    from bench.workers.common import prompts

    for i, prompt in enumerate(prompts(batch, context, seed=seed)):
        eng.add_request(f"p{seed}-{i}", prompt,
                        eng.make_params({"temperature": 0, "max_tokens": steps + 4, "ignore_eos": True}))
    sched = eng.scheduler
    while sched.waiting or any(s.num_pending > 1 for s in sched.running):
        eng.step()   # the prefills (and each sequence's first token)
    eng.step()
    if timer:
        timer.install()
    times = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t0)
    finally:
        if timer:
            timer.remove()
    while eng.has_unfinished():
        eng.step()
    return times


def profile_round(eng, threads: int, context: int, steps: int, seed: int, loops: tuple[str, ...] = ("on",)) -> dict:
    torch.set_num_threads(threads)
    model = eng.runner.model
    decode_steps(eng, context, 4, seed=seed + 99)   # warm (and the team at this width)
    by_loop = {}
    for loop in loops:
        model.use_layer_loop = loop == "on"
        by_loop[loop] = sum(decode_steps(eng, context, steps, seed=seed)) / steps * 1000
    model.use_layer_loop = False   # the kernel calls are timed on the Python loop
    timer = OpTimer(eng.runner)
    try:
        timed = decode_steps(eng, context, steps, seed=seed + 1, timer=timer)
    finally:
        model.use_layer_loop = True
    step_ms = by_loop["on"] if "on" in by_loop else by_loop["off"]
    timed_ms = sum(timed) / steps * 1000
    ops = {}
    for label in sorted(timer.ns, key=lambda k: -timer.ns[k]):
        ms = timer.ns[label] / steps / 1e6
        ops[label] = {"ms_per_step": ms, "calls_per_step": timer.calls[label] / steps,
                      "gb_per_s": (timer.bytes[label] / (timer.ns[label] / 1e9) / 1e9) if timer.bytes[label] else None,
                      "mb_per_step": timer.bytes[label] / steps / 1e6}
    rest = timed_ms - sum(o["ms_per_step"] for o in ops.values())
    return {"threads": threads, "step_ms": step_ms, "tokens_per_s": 1000 / step_ms, "step_ms_by_layer_loop": by_loop,
            "timed_step_ms_mean": timed_ms, "wrapper_overhead_ms": timed_ms - step_ms,
            "ops": ops, "python_and_rest_ms": rest,
            "mb_per_token": sum(o["mb_per_step"] for o in ops.values())}


def profile(eng, thread_counts: list[int], context: int, steps: int, rounds: int,
            loops: tuple[str, ...] = ("on",)) -> list[dict]:
    """`rounds` rounds, the thread counts alternated within each; per thread count the round whose timed step
    was fastest (on a shared host the others are the neighbours' doing), with every round's step times kept."""
    best: dict[int, dict] = {}
    seen: dict[int, list[tuple[float, float]]] = {t: [] for t in thread_counts}
    by_loop: dict[int, dict[str, list[float]]] = {t: {lp: [] for lp in loops} for t in thread_counts}
    for r in range(rounds):
        for t in thread_counts:
            order = loops if r % 2 == 0 else loops[::-1]   # neither setting always runs first
            res = profile_round(eng, t, context, steps, seed=10 * r + 1, loops=order)
            seen[t].append((res["step_ms"], res["timed_step_ms_mean"]))
            for lp, ms in res["step_ms_by_layer_loop"].items():
                by_loop[t][lp].append(ms)
            if t not in best or res["timed_step_ms_mean"] < best[t]["timed_step_ms_mean"]:
                best[t] = res
    out = []
    for t in thread_counts:
        best[t]["rounds_step_ms"] = [p for p, _ in seen[t]]
        best[t]["step_ms_best"] = min(p for p, _ in seen[t])
        best[t]["layer_loop_rounds_step_ms"] = by_loop[t]
        best[t]["stream_read_gb_per_s"] = stream_read_gbs(t)
        out.append(best[t])
    return out


def layer_loop_ab(eng, threads: int, context: int, steps: int, block: int = 4) -> dict:
    """Per-step times of one sequence's decode with the C++ layer loop on and off, switched every `block` steps
    (an A/B in the same seconds): min, 10th percentile and median per setting, in ms."""
    from bench.workers.common import prompts

    torch.set_num_threads(threads)
    model = eng.runner.model
    eng.add_request(f"ab{threads}", prompts(1, context, seed=threads)[0],
                    eng.make_params({"temperature": 0, "max_tokens": steps + 8, "ignore_eos": True}))
    for _ in range(4):   # prefill and warm steps
        eng.step()
    times: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for i in range(steps):
            loop = "on" if (i // block) % 2 == 0 else "off"
            model.use_layer_loop = loop == "on"
            t0 = time.perf_counter()
            eng.step()
            times[loop].append((time.perf_counter() - t0) * 1000)
    finally:
        model.use_layer_loop = True
    while eng.has_unfinished():
        eng.step()
    out = {}
    for loop, ts in times.items():
        ts = sorted(ts)
        out[loop] = {"min": ts[0], "p10": ts[len(ts) // 10], "median": ts[len(ts) // 2], "n": len(ts)}
    return out


# decode_layers_profile's phases (csrc/decode_layers.cpp, enum Phase), grouped into the rows of the region table
REGION_PHASES = ("prologue fork normIn qkv qkvWait rope kvWrite attn attnWait quantO o oWait normPost gateUp gateUpWait silu "
                 "down downWait final "
                 "router routerWait route gather expGateUp expGateUpWait expSilu expDown expDownWait combine").split()
REGION_ROWS = (
    ("GEMV qkv_proj", ("qkv",), "qkv_proj"),
    ("GEMV gate_up_proj", ("gateUp",), "gate_up_proj"),
    ("GEMV down_proj", ("down",), "down_proj"),
    ("GEMV o_proj", ("o",), "o_proj"),
    ("attention items: paged attention", ("attn",), None),
    ("attention items: q/k-norm + RoPE, KV write", ("rope", "kvWrite"), None),
    ("row ops: add + RMSNorm, activation quantization, SwiGLU, final norm", ("normIn", "quantO", "normPost", "silu", "final"), None),
    # Qwen3-MoE's sparse layers (batch 1: the bytes of the top-k experts' weights per layer)
    ("MoE router GEMV", ("router",), "router"),
    ("MoE routing: softmax, top-k, the plan (one thread; csrc/route.cpp)", ("route",), "sparse"),
    ("MoE experts gate_up (the routed experts)", ("expGateUp",), "experts_gate_up"),
    ("MoE experts down (the routed experts)", ("expDown",), "experts_down"),
    ("MoE row ops: gather, SwiGLU, combine", ("gather", "expSilu", "combine"), "sparse"),
    ("barrier waits (GEMV tails, attention items)", ("qkvWait", "attnWait", "oWait", "gateUpWait", "downWait",
                                                     "routerWait", "expGateUpWait", "expDownWait"), None),
    ("layers call before the region: argument checks, pointers (C++)", ("prologue",), None),
    ("region entry (fork)", ("fork",), None),
)


def _prepared_bytes(mod) -> int:
    """Bytes of a module's prepared weight tensors (0 for a module without one)."""
    return sum(t.numel() * t.element_size() for t in (getattr(mod, "prepared", None) or ())
               if isinstance(t, torch.Tensor))


def _region_bytes(model, what: str) -> int | None:
    """Bytes a batch-1 step reads for a row of the region table (a projection over the layers that have it; the
    MoE rows: the routers, the top-k experts' weights), 0 for a row of no weights, None where no layer has it."""
    from backend_lib.layers.moe import Qwen3SparseMoe

    sparse = [layer.mlp for layer in model.layers if type(layer.mlp) is Qwen3SparseMoe]
    if what in ("qkv_proj", "o_proj"):
        return sum(_prepared_bytes(getattr(layer.self_attn, what)) for layer in model.layers)
    if what in ("gate_up_proj", "down_proj"):
        mods = [getattr(layer.mlp, what) for layer in model.layers if hasattr(layer.mlp, what)]
        return sum(_prepared_bytes(m) for m in mods) if mods else None
    if not sparse:
        return None
    if what == "router":
        return sum(_prepared_bytes(m.gate) for m in sparse)
    if what == "sparse":
        return 0
    j = 0 if what == "experts_gate_up" else 1
    return sum(m.top_k * _prepared_bytes(next(p for p in m.expert_pairs if p is not None)[j]) for m in sparse)


def kv_bytes_per_token(eng) -> int:
    """Bytes of KV cache one position holds over all layers (keys and values), at the engine's cache's layout: what a
    decode step's attention reads per position of its context."""
    from backend_lib.kv_cache import cache_class

    mc = eng.model_config
    return cache_class(eng.cfg.kv_cache).bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, eng.dtype)


def kv_bytes_per_step(eng, context: int, steps: int) -> int:
    """Bytes of KV cache a timed step of decode_steps reads, averaged over its steps: every layer's keys and values of
    each position before it (the prefill of `context` tokens and one untimed decode step come first, so timed step i
    attends over context + 2 + i positions)."""
    return round(kv_bytes_per_token(eng) * (context + 2 + (steps - 1) / 2))


def region_round(eng, threads: int, context: int, steps: int, seed: int, batch: int = 1) -> dict:
    """`batch` sequences' decode with the C++ layer loop (one by default), its one parallel region accounted per phase
    (torch.ops.qwen3_cpu.decode_layers_profile, per step; the median over steps of each phase, averaged over the
    threads, whose phases each sum to the region's time) and the kernels called from Python (the head, the
    embedding rows, sampling, prepare) timed as in the Python-loop profile."""
    torch.set_num_threads(threads)
    model = eng.runner.model
    model.use_layer_loop = True
    decode_steps(eng, context, 4, seed=seed + 99, batch=batch)   # warm (and the team at this width)
    loop = model.layer_loop
    prof = torch.ops.qwen3_cpu.decode_layers_profile

    class Timer(OpTimer):   # also: the layer-loop calls and their region profile while the timed steps run
        active = False

        def install(self):
            super().install()
            self.active = True

        def remove(self):
            self.active = False
            super().remove()

    timer = Timer(eng.runner)
    layer_ns: list[int] = []
    profs: list[torch.Tensor] = []

    class TimedLoop:
        applies = staticmethod(loop.applies)

        def __call__(self, *a):
            t0 = time.perf_counter_ns()
            out = loop(*a)
            t1 = time.perf_counter_ns()
            p = prof(True)   # this call's phases (and reset)
            if timer.active:
                layer_ns.append(t1 - t0)
                profs.append(p)
            return out

    model.layer_loop = TimedLoop()
    prof(True)
    try:
        timed = decode_steps(eng, context, steps, seed=seed, timer=timer, batch=batch)
    finally:
        model.layer_loop = loop
        prof(False)
    profs = [p for p in profs if p[0, -1].item() == 1]   # the timed steps that ran in the region
    med = lambda v: sorted(v)[len(v) // 2]
    n_threads = min(p.shape[0] for p in profs)
    phase_ms = {ph: sum(med([p[t, j].item() * 1e3 for p in profs]) for t in range(n_threads)) / n_threads
                for j, ph in enumerate(REGION_PHASES)}
    phase_ms["prologue"] = med([p[0, 0].item() * 1e3 for p in profs])   # the calling thread's, before the region
    step_ms = med(timed) * 1000
    ops = {}
    for label, phases, lin in REGION_ROWS:
        ms = sum(phase_ms[ph] for ph in phases)
        nbytes = 0
        if label == "attention items: paged attention":   # the KV rows it reads: part of the step's bytes
            nbytes = kv_bytes_per_step(eng, context, steps)
            ops[label] = {"ms_per_step": ms, "mb_per_step": nbytes / 1e6,
                          "gb_per_s": nbytes / 1e6 / (ms + phase_ms["attnWait"]), "kv": True}
            continue
        if lin:
            nbytes = _region_bytes(model, lin)
            if nbytes is None:   # no such layer in this model
                continue
            lin = lin if nbytes else None
            wait = phase_ms.get(phases[0] + "Wait", 0.0)
        ops[label] = {"ms_per_step": ms, "mb_per_step": nbytes / 1e6,
                      "gb_per_s": nbytes / 1e6 / (ms + wait) if lin else None}   # read rate over work + tail
    region_ms = sum(v for ph, v in phase_ms.items() if ph != "prologue")
    ops["layers call: the rest (the Python around the op, its dispatch, the team's wake-up and join)"] = {
        "ms_per_step": med(layer_ns) / 1e6 - region_ms - phase_ms["prologue"], "mb_per_step": 0, "gb_per_s": None}
    for label in sorted(timer.ns, key=lambda k: -timer.ns[k]):
        ms = timer.ns[label] / steps / 1e6
        ops[label] = {"ms_per_step": ms, "mb_per_step": timer.bytes[label] / steps / 1e6,
                      "gb_per_s": (timer.bytes[label] / (timer.ns[label] / 1e9) / 1e9) if timer.bytes[label] else None}
    rest = step_ms - med(layer_ns) / 1e6 - sum(timer.ns.values()) / steps / 1e6
    if batch > 1:   # the byte counts above are one sequence's (a batch shares the weights, the MoE's touched experts
        for o in ops.values():   # vary): time per phase only
            o.update(mb_per_step=0, gb_per_s=None, kv=False)
    return {"threads": threads, "batch": batch, "step_ms": step_ms, "region_ms": region_ms, "ops": ops,
            "python_and_rest_ms": rest,
            "mb_per_token": sum(o["mb_per_step"] for o in ops.values()),
            "kv_mb_per_token": sum(o["mb_per_step"] for o in ops.values() if o.get("kv")), "phase_ms": phase_ms,
            "steps_in_region": len(profs)}


def region_table(results: list[dict]) -> str:
    head = " | ".join(f"{r['threads']} thread{'s' if r['threads'] > 1 else ''}: ms (share), GB/s" for r in results)
    md = [f"| operation (one region per step; median step) | {head} |", "|---|" + "---|" * len(results)]
    for label in list(results[0]["ops"]) + ["Python and the rest"]:
        cells = []
        for r in results:
            ms, gbs = ((r["python_and_rest_ms"], None) if label == "Python and the rest"
                       else (r["ops"][label]["ms_per_step"], r["ops"][label]["gb_per_s"]))
            cells.append(f"{ms:.2f} ({ms / r['step_ms'] * 100:.0f} %)" + (f", {gbs:.1f}" if gbs else ""))
        md.append(f"| {label} | " + " | ".join(cells) + " |")
    batch = results[0].get("batch", 1)
    md.append("| **step (median)** | " + " | ".join(
        f"{r['step_ms']:.2f} ms ({batch * 1000 / r['step_ms']:.1f} tokens/s; region {r['region_ms']:.2f})"
        for r in results) + " |")
    if batch > 1:   # no floor: the byte counts are one sequence's
        md.append(f"| batch | {batch} sequences a step (time per phase only) |")
        return "\n".join(md)
    md.append("| bytes read per token (weights + KV cache); STREAM read; floor; step / floor | " + " | ".join(
        f"{r['mb_per_token']:.0f} MB ({r['mb_per_token'] - r['kv_mb_per_token']:.0f} + {r['kv_mb_per_token']:.1f}); "
        f"{r['stream_read_gb_per_s']:.1f} GB/s; {r['mb_per_token'] / r['stream_read_gb_per_s']:.2f} ms; "
        f"{r['mb_per_token'] / r['stream_read_gb_per_s'] / r['step_ms']:.2f}x" for r in results) + " |")
    md.append("| the same, weights only (the KV rows left out of the floor) | " + " | ".join(
        f"{(r['mb_per_token'] - r['kv_mb_per_token']) / r['stream_read_gb_per_s'] / r['step_ms']:.2f}x"
        for r in results) + " |")
    return "\n".join(md)


def table(results: list[dict]) -> str:
    labels = list(dict.fromkeys(k for r in results for k in r["ops"]))
    head = " | ".join(f"{r['threads']} thread{'s' if r['threads'] > 1 else ''}: ms (share), GB/s" for r in results)
    md = [f"| operation (calls per step) | {head} |", "|---|" + "---|" * len(results)]
    for label in labels + ["Python and the rest"]:
        cells, calls = [], None
        for r in results:
            if label == "Python and the rest":
                ms, gbs = r["python_and_rest_ms"], None
            else:
                o = r["ops"].get(label)
                if o is None:
                    cells.append("-")
                    continue
                ms, gbs, calls = o["ms_per_step"], o["gb_per_s"], o["calls_per_step"]
            cells.append(f"{ms:.2f} ({ms / r['timed_step_ms_mean'] * 100:.0f} %)" + (f", {gbs:.1f}" if gbs else ""))
        md.append(f"| {label}" + (f" ({calls:.0f})" if calls else "") + " | " + " | ".join(cells) + " |")
    md.append("| **step, timed / as the engine runs (ms, mean)** | " + " | ".join(
        f"{r['timed_step_ms_mean']:.2f} / {r['step_ms']:.2f} ({r['tokens_per_s']:.1f} tokens/s)"
        for r in results) + " |")
    md.append("| weights read per token; STREAM read; floor | " + " | ".join(
        f"{r['mb_per_token']:.0f} MB; {r['stream_read_gb_per_s']:.1f} GB/s; "
        f"{r['stream_read_gb_per_s'] * 1e3 / r['mb_per_token']:.1f} tokens/s" for r in results) + " |")
    return "\n".join(md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=str(ROOT / "demo_checkpoints" / "qwen3-0.6b-a8w8"))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--layer-loop", default="on", help="on / off / on,off: the untimed steps with the C++ layer loop, "
                    "the Python one, or both alternated in every round")
    ap.add_argument("--ab-steps", type=int, default=0, help="instead of the profile: N decode steps per thread count "
                    "with the C++ layer loop switched on and off every 4 steps; min / p10 / median step per setting")
    ap.add_argument("--region", action="store_true", help="instead of the Python-loop profile: the C++ layer loop's one "
                    "parallel region per step, per phase (decode_layers_profile), with the head, sampling and the rest; "
                    "each thread count's fastest of --rounds rounds, a STREAM read right after it")
    ap.add_argument("--batch", type=int, default=1, help="with --region: this many sequences decode together (time "
                    "per phase; GB/s only at 1, whose bytes are one sequence's)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--lm-head-quant", default="checkpoint", help="checkpoint (the head as stored), int8, int4 or "
                    "int4a8 (EngineConfig.lm_head_quant: the heads the MoE group's engines run)")
    ap.add_argument("--moe-experts-quant", default="checkpoint", help="checkpoint (a MoE's experts as stored) or "
                    "int4a8 (EngineConfig.moe_experts_quant: int4 codes on int8 activations)")
    ap.add_argument("--int4-activations", default="checkpoint", help="checkpoint (an int4 checkpoint's attention and "
                    "dense MLP on the W4A16 kernel) or int8 (EngineConfig.int4_activations: their codes on int8 "
                    "activations)")
    ap.add_argument("--greedy-head", default="auto", help="auto / int8 / off (EngineConfig.greedy_head: the int8 screen "
                    "of a float head's greedy rows; auto: on with the checkpoint's head on the CPU set)")
    args = ap.parse_args()
    from backend_lib.config import EngineConfig
    from backend_lib.engine import LLMEngine

    if args.batch > 1 and not args.region:
        ap.error("--batch: with --region")
    eng = LLMEngine(EngineConfig(checkpoint=args.checkpoint, kv_cache_memory="256MiB" if args.batch == 1 else "1GiB",
                                 max_model_len=1100, max_num_seqs=args.batch, enable_prefix_caching=False,
                                 lm_head_quant=args.lm_head_quant, greedy_head=args.greedy_head,
                                 moe_experts_quant=args.moe_experts_quant, int4_activations=args.int4_activations))
    if args.ab_steps:
        res = []
        for t in [int(t) for t in args.threads.split(",")]:
            r = {"threads": t, **layer_loop_ab(eng, t, args.context, args.ab_steps)}
            for loop in ("on", "off"):
                f = r[loop]
                print(f"threads {t}: layer loop {loop}: step ms min {f['min']:.2f}, p10 {f['p10']:.2f}, median "
                      f"{f['median']:.2f} ({f['n']} steps)")
            r["stream_read_gb_per_s"] = stream_read_gbs(t)
            print(f"threads {t}: STREAM read {r['stream_read_gb_per_s']:.1f} GB/s")
            res.append(r)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        return
    if args.region:
        best: dict[int, dict] = {}
        for r in range(args.rounds):
            for t in [int(t) for t in args.threads.split(",")]:
                res = region_round(eng, t, args.context, args.steps, seed=10 * r + 1, batch=args.batch)
                res["stream_read_gb_per_s"] = stream_read_gbs(t)
                res["rounds_step_ms"] = best.get(t, {}).get("rounds_step_ms", []) + [res["step_ms"]]
                if t not in best or res["step_ms"] < best[t]["step_ms"]:
                    best[t] = res
                else:
                    best[t]["rounds_step_ms"] = res["rounds_step_ms"]
        results = list(best.values())
        from backend_lib.kernels.cpu.build import cpu_isa

        print(f"CPU kernels built for QWEN3_CPU_ISA={cpu_isa()} (kernels/cpu/build.py)")
        print(region_table(results))
        for r in results:
            print(f"threads {r['threads']}: median step per round " + ", ".join(f"{v:.2f}" for v in r["rounds_step_ms"])
                  + f" ms; {r['steps_in_region']} steps in the region")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        return
    loops = tuple(args.layer_loop.split(","))
    if not set(loops) <= {"on", "off"}:
        ap.error("--layer-loop: on, off or on,off")
    results = profile(eng, [int(t) for t in args.threads.split(",")], args.context, args.steps, args.rounds, loops)
    print(table(results))
    for r in results:
        print(f"threads {r['threads']}: wrapper overhead {r['wrapper_overhead_ms']:.2f} ms per step; step ms of "
              f"every round (untimed): " + ", ".join(f"{v:.1f}" for v in r["rounds_step_ms"]))
        for lp, ms in r["layer_loop_rounds_step_ms"].items():
            print(f"threads {r['threads']}: layer loop {lp}: step ms per round " + ", ".join(f"{v:.2f}" for v in ms)
                  + f"; best {min(ms):.2f} ms ({1000 / min(ms):.1f} tokens/s, "
                  f"{1000 / min(ms) / (r['stream_read_gb_per_s'] * 1e3 / r['mb_per_token']):.2f}x the floor)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
