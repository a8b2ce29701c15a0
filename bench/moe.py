"""One Qwen3-MoE sparse layer at Qwen3-30B-A3B's shape (hidden 2048, 128 experts of width 768, 8 per token),
random weights, the CPU kernel set: the MoE block against the dense GEMV that reads the same bytes.

    python -m bench.moe [--format a8w8|bf16] [--batch 1,16] [--repeats 20]
    python -m bench.moe --checkpoint DIR [--batch 1,16]      # engine decode tokens/s of a MoE checkpoint
                                                             # (e.g. make_demo_checkpoint --size 30b-a3b --layers 2)

At batch 1 the block must read only the 8 routed experts' weights (+ the router): its time is compared with one
dense linear pair of exactly those bytes (gate_up [8 x 2 x 768, 2048], down [2048, 8 x 768]), several copies
cycled so each call streams from DRAM as the experts do (128 experts x 3 matrices, 604 MB in int8: never
cached). At batch B the block reads each touched expert once: bytes = touched experts x expert bytes + router.
The two are interleaved call by call (A, B, A, B, ...), each figure the median; on a shared host only the ratio
means something.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from backend_lib.kernels import get_kernels
from backend_lib.layers.linear import A8W8Linear, FloatLinear
from backend_lib.layers.moe import Qwen3SparseMoe, route

HIDDEN, EXPERTS, WIDTH, TOP_K = 2048, 128, 768, 8


def _linear(fmt, n, k, kernels, g):
    w = torch.randn(n, k, generator=g) * 0.05
    if fmt == "a8w8":
        return A8W8Linear(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g),
                          torch.rand(n, generator=g) * 1e-3 + 1e-4, kernels)
    return FloatLinear(w.to(torch.bfloat16), kernels)


def _bytes(fmt, n, k):
    return n * k * (1 if fmt == "a8w8" else 2) + (4 * n if fmt == "a8w8" else 0)


def engine_decode(checkpoint: str, batches: list[int], steps: int = 16) -> None:
    """Decode step time of the engine (bf16 compute): a run of 1 token subtracted from a run of 1 + steps."""
    from backend_lib.config import EngineConfig
    from backend_lib.engine import LLMEngine

    eng = LLMEngine(EngineConfig(checkpoint=checkpoint, dtype="bfloat16", max_num_seqs=max(batches),
                                 max_num_batched_tokens=256, kv_cache_memory="256MiB", max_model_len=1024))
    rss = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS"))
    print(f"{checkpoint}: RSS after load {rss / 2 ** 20:.2f} GiB")
    for b in batches:
        prompts = [eng.tokenizer.encode(f"Prompt number {i}: tell me a story") for i in range(b)]
        one = eng.make_params({"temperature": 0, "max_tokens": 1, "ignore_eos": True})
        many = eng.make_params({"temperature": 0, "max_tokens": 1 + steps, "ignore_eos": True})
        eng.generate(prompts, one)
        t0 = time.perf_counter()
        eng.generate(prompts, one)
        t1 = time.perf_counter()
        eng.generate(prompts, many)
        step = (time.perf_counter() - t1 - (t1 - t0)) / steps
        print(f"batch {b:3d}: decode step {step * 1e3:7.1f} ms, {b / step:6.1f} tokens/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", choices=("a8w8", "bf16"), default="a8w8")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--checkpoint", default=None)
    args = ap.parse_args()
    if args.checkpoint:
        engine_decode(args.checkpoint, [int(v) for v in args.batch.split(",")])
        return
    kernels = get_kernels("cpu", "cpu")
    g = torch.Generator().manual_seed(0)
    fmt = args.format
    experts = [(_linear(fmt, 2 * WIDTH, HIDDEN, kernels, g), _linear(fmt, HIDDEN, WIDTH, kernels, g))
               for _ in range(EXPERTS)]
    router = FloatLinear((torch.randn(EXPERTS, HIDDEN, generator=g) * 0.05).to(torch.bfloat16), kernels)
    block = Qwen3SparseMoe(router, experts, TOP_K, True, kernels)
    expert_bytes = _bytes(fmt, 2 * WIDTH, HIDDEN) + _bytes(fmt, HIDDEN, WIDTH)
    router_bytes = EXPERTS * HIDDEN * 2
    dense = [(_linear(fmt, TOP_K * 2 * WIDTH, HIDDEN, kernels, g), _linear(fmt, HIDDEN, TOP_K * WIDTH, kernels, g))
             for _ in range(4)]
    print(f"format {fmt}: expert {expert_bytes / 1e6:.2f} MB, router {router_bytes / 1e6:.2f} MB, "
          f"all experts {EXPERTS * expert_bytes / 1e6:.0f} MB")
    with torch.inference_mode():
        for b in (int(v) for v in args.batch.split(",")):
            xs = [torch.randn(b, HIDDEN, generator=g).to(torch.bfloat16) for _ in range(args.repeats)]
            moe_t, dense_t, touched = [], [], []
            for i, x in enumerate(xs):
                ids, _ = route(router.forward(x), TOP_K, True)
                touched.append(len(set(ids.flatten().tolist())))
                t0 = time.perf_counter()
                block.forward(x)
                moe_t.append(time.perf_counter() - t0)
                gu, down = dense[i % len(dense)]
                t0 = time.perf_counter()
                down.forward(kernels.silu_mul(gu.forward(x)))
                dense_t.append(time.perf_counter() - t0)
            tm, td = statistics.median(moe_t), statistics.median(dense_t)
            nbytes = statistics.median(touched) * expert_bytes + router_bytes
            dense_bytes = TOP_K * expert_bytes
            print(f"batch {b:3d}: MoE block {tm * 1e3:7.2f} ms ({statistics.median(touched):.0f} experts touched, "
                  f"{nbytes / tm / 1e9:5.1f} GB/s); dense GEMV pair of the 8 experts' bytes {td * 1e3:7.2f} ms "
                  f"({dense_bytes / td / 1e9:5.1f} GB/s); MoE bandwidth / dense = "
                  f"{(nbytes / tm) / (dense_bytes / td):.2f}")


if __name__ == "__main__":
    main()
