"""W4A16 vs A8W8 linear microbenchmark on the 8B shapes (Qwen3-8B: hidden 4096, 32 heads / 8 KV heads of 128,
intermediate 12288, 36 layers), random weights, the CPU kernel set.

    python -m bench.w4a16 [--batch 1,16] [--threads 1,2] [--group 128] [--repeats 12] [--shapes ...]

Each shape is timed as decode meets it: the weights cold (several copies, together well past the L3 cache,
are cycled, so every call streams its weight from DRAM, as one step through 36 layers does), one call at a time,
the systems alternated call by call (A, B, A, B, ...), the figure the fastest of `--repeats` calls. GB/s counts
the bytes a call must read: int4 codes + fp32 scales and zeros per group for W4A16, int8 codes + fp32 scale per
row for A8W8. W4A16 is symmetric (one zero point: the batch-1 table lookup), W4A16 asym has a zero point per
group (AWQ, asymmetric GPTQ / compressed-tensors); fp16 scales. The decode-step estimate is 36 x the fused per-layer linears (qkv, o, gate_up, down) at batch 1:
the linears only (the lm_head, attention and norms are the same for both formats and left out).
"""
from __future__ import annotations

import argparse
import time

import torch

from backend_lib.kernels import get_kernels

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 4096, 32, 8, 128, 12288, 36
# name -> (N out, K in); the engine fuses q/k/v and gate/up into one linear each.
SHAPES = {
    "q_proj": (HEADS * HEAD_DIM, HIDDEN), "k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
    "o_proj": (HIDDEN, HEADS * HEAD_DIM), "gate_proj": (INTER, HIDDEN), "down_proj": (HIDDEN, INTER),
    "qkv_proj (fused)": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), "gate_up_proj (fused)": (2 * INTER, HIDDEN),
}
STEP = ("qkv_proj (fused)", "o_proj", "gate_up_proj (fused)", "down_proj")
COLD_BYTES = 256 << 20   # per system and shape: the copies cycled (L3 here: 32 MiB)


def _systems(kernels, n: int, k: int, group: int):
    w4_bytes = n * k // 2 + 2 * 4 * n * (k // group)
    a8_bytes = n * k + 4 * n
    copies = lambda b: max(2, -(-COLD_BYTES // b))
    gen = torch.Generator().manual_seed(0)

    def w4(symmetric):   # fp16 scales, as GPTQ / AWQ store them (compressed-tensors: bf16)
        zeros = torch.full((n, k // group), 8.0) if symmetric else torch.randint(0, 16, (n, k // group), generator=gen)
        return kernels.w4a16_prepare(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen),
                                     (torch.rand(n, k // group, generator=gen) * 0.01 + 1e-3).half().float(),
                                     zeros.float(), None)
    a8 = [kernels.a8w8_prepare(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen),
                               torch.rand(n, generator=gen) * 0.01 + 1e-3) for _ in range(copies(a8_bytes))]
    return {"W4A16": (kernels.w4a16_linear, [w4(True) for _ in range(copies(w4_bytes))], w4_bytes),
            "W4A16 asym": (kernels.w4a16_linear, [w4(False) for _ in range(copies(w4_bytes))], w4_bytes),
            "A8W8": (kernels.a8w8_linear, a8, a8_bytes)}


def _time(systems, x, repeats):
    best = {name: float("inf") for name in systems}
    for name, (fn, ws, _) in systems.items():   # warm up (the first call allocates)
        fn(x, ws[0])
    for i in range(repeats):
        for name, (fn, ws, _) in systems.items():
            w = ws[i % len(ws)]
            t0 = time.perf_counter()
            fn(x, w)
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of " + ", ".join(SHAPES))
    args = ap.parse_args()
    kernels = get_kernels("cpu")
    assert kernels.name == "cpu", "the compiled CPU kernels did not build"
    batches = [int(b) for b in args.batch.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    names = [s.strip() for s in args.shapes.split(",")]
    step = {}
    print("| shape (N x K) | batch | threads | W4A16 ms | GB/s | W4A16 asym ms | GB/s | A8W8 ms | GB/s | "
          "W4A16 / asym speed-up |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        n, k = SHAPES[name]
        systems = _systems(kernels, n, k, args.group)
        for b in batches:
            x = torch.randn(b, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
            for t in threads:
                torch.set_num_threads(t)
                best = _time(systems, x, args.repeats)
                w4, w4a, a8 = best["W4A16"], best["W4A16 asym"], best["A8W8"]
                step[(name, b, t)] = (w4, w4a, a8)
                gb = lambda s, v: systems[s][2] / v / 1e9
                print(f"| {name} {n} x {k} | {b} | {t} | {w4 * 1e3:.3f} | {gb('W4A16', w4):.1f} | {w4a * 1e3:.3f} | "
                      f"{gb('W4A16', w4a):.1f} | {a8 * 1e3:.3f} | {gb('A8W8', a8):.1f} | {a8 / w4:.2f}x / {a8 / w4a:.2f}x |",
                      flush=True)
        del systems
    for b in batches:
        for t in threads:
            if all((s, b, t) in step for s in STEP):
                w4, w4a, a8 = (LAYERS * sum(step[(s, b, t)][i] for s in STEP) for i in range(3))
                print(f"8B decode step, linears only (36 layers), batch {b}, {t} thread(s): W4A16 {w4 * 1e3:.1f} ms "
                      f"({b / w4:.2f} tok/s), asym {w4a * 1e3:.1f} ms ({b / w4a:.2f} tok/s), A8W8 {a8 * 1e3:.1f} ms "
                      f"({b / a8:.2f} tok/s): {a8 / w4:.2f}x / {a8 / w4a:.2f}x")


if __name__ == "__main__":
    main()
