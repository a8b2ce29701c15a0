"""One Qwen3-MoE sparse layer at Qwen3-30B-A3B's shape (hidden 2048, 128 experts of width 768, 8 per token),
random weights, the CPU kernel set: the MoE block against the dense GEMV that reads the same bytes.

    python -m bench.moe [--format a8w8|w4a16|bf16] [--batch 1,16] [--repeats 20]
    python -m bench.moe --checkpoint DIR [--batch 1,16]      # engine decode tokens/s of a MoE checkpoint
                                                             # (e.g. make_demo_checkpoint --size 30b-a3b --layers 2)
    python -m bench.moe --checkpoint DIR --triton             # the same checkpoint streamed through tritonserver
    python -m bench.moe --group [--layers 4] [--rounds 3]    # the MoE group: engine A8W8 / W4A16 vs llama.cpp
                                                             # qwen3moe Q8_0 / Q4_0, interleaved (bench/moe_group.py)

The full Qwen3-30B-A3B shape in W4A16 (~16 GB, written tensor by tensor) within a 23 GB machine:
    nice python -m backend_lib.tools.make_demo_checkpoint demo_checkpoints/qwen3-30b-a3b-w4a16 --size 30b-a3b \
        --format w4a16 --group-size 128 --stream
    python -m bench.moe --checkpoint demo_checkpoints/qwen3-30b-a3b-w4a16 --batch 1 [--triton]

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
from backend_lib.layers.linear import A8W8Linear, FloatLinear, W4A16Linear
from backend_lib.layers.moe import Qwen3SparseMoe, route

HIDDEN, EXPERTS, WIDTH, TOP_K = 2048, 128, 768, 8


def _linear(fmt, n, k, kernels, g):
    if fmt == "w4a16":   # symmetric, group 128, bf16-exact scales: the published W4A16 layout's arithmetic
        from backend_lib.checkpoint.int4 import Int4Weight

        scales = (torch.rand(n, k // 128, generator=g) * 0.01).to(torch.bfloat16).float()
        return W4A16Linear(Int4Weight(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g), scales,
                                      torch.full_like(scales, 8.0), 128, None), kernels)
    w = torch.randn(n, k, generator=g) * 0.05
    if fmt == "a8w8":
        return A8W8Linear(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g),
                          torch.rand(n, generator=g) * 1e-3 + 1e-4, kernels)
    return FloatLinear(w.to(torch.bfloat16), kernels)


def _bytes(fmt, n, k):
    if fmt == "w4a16":
        return n * k // 2 + n * (k // 128) * 8
    return n * k * (1 if fmt == "a8w8" else 2) + (4 * n if fmt == "a8w8" else 0)


def _status(key: str) -> float:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key)) / 2 ** 20


def engine_decode(checkpoint: str, batches: list[int], steps: int = 16, kv_cache_memory: str = "1GiB") -> None:
    """Load (with a KV pool of kv_cache_memory), RSS after load, then the decode step time of the engine (bf16
    compute): a run of 1 token subtracted from a run of 1 + steps."""
    from backend_lib.config import EngineConfig
    from backend_lib.engine import LLMEngine

    t0 = time.perf_counter()
    eng = LLMEngine(EngineConfig(checkpoint=checkpoint, dtype="bfloat16", max_num_seqs=max(batches),
                                 max_num_batched_tokens=256, kv_cache_memory=kv_cache_memory, max_model_len=1024))
    print(f"{checkpoint}: loaded in {time.perf_counter() - t0:.0f} s with a {kv_cache_memory} KV pool; RSS after "
          f"load {_status('VmRSS'):.2f} GiB (anonymous {_status('RssAnon'):.2f}, file-backed {_status('RssFile'):.2f}),"
          f" peak {_status('VmHWM'):.2f} GiB")
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
    print(f"RSS after decoding {_status('VmRSS'):.2f} GiB, peak {_status('VmHWM'):.2f} GiB")


def triton_stream(checkpoint: str, new_tokens: int = 16, kv_cache_memory: str = "1GiB") -> None:
    """The checkpoint served by the real tritonserver (the Python backend, decoupled streaming over gRPC): one
    streamed greedy request, its tokens/s and the model's stub RSS."""
    import asyncio
    import tempfile
    from pathlib import Path

    from client.loadgen import run_load
    from harness.triton_server import TritonServer, make_repository

    out = Path(tempfile.mkdtemp(prefix="bench-moe-triton-"))
    repo = make_repository(out / "models", {"qwen3_a8w8": {"checkpoint": checkpoint, "kv_cache_memory": kv_cache_memory,
                                                          "max_model_len": "1024", "max_num_seqs": "4"}})
    t0 = time.perf_counter()
    server = TritonServer(repo, out / "tritonserver.log").start(timeout=3600)
    try:
        print(f"tritonserver ready in {time.perf_counter() - t0:.0f} s; model stub RSS "
              f"{server.rss_mib('qwen3_a8w8') / 1024:.2f} GiB")
        req = {"input_ids": list(range(1000, 1032)), "stream": True, "max_tokens": new_tokens,
               "sampling_parameters": {"temperature": 0, "ignore_eos": True}}
        t0 = time.perf_counter()
        r = asyncio.run(run_load(server.grpc_url, "qwen3_a8w8", 1, [req]))
        wall = time.perf_counter() - t0
        if r["errors"]:
            raise SystemExit(f"tritonserver returned errors: {r['error_messages']}")
        print(f"streamed {new_tokens} tokens through tritonserver in {wall:.1f} s (first token "
              f"{r['time_to_first_token_s']['avg']:.2f} s, then {1 / r['inter_token_latency_s']['avg']:.1f} "
              f"tokens/s); stub RSS {server.rss_mib('qwen3_a8w8') / 1024:.2f} GiB")
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", choices=("a8w8", "w4a16", "bf16"), default="a8w8")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--kv-cache-memory", default="1GiB", help="--checkpoint: the KV pool")
    ap.add_argument("--triton", action="store_true", help="--checkpoint: stream through tritonserver instead")
    ap.add_argument("--group", action="store_true", help="the interleaved MoE group beside llama.cpp")
    ap.add_argument("--size", default="30b-a3b", choices=("30b-a3b", "tiny-moe"),
                    help="--group: the shape (tiny-moe: a smoke run of the whole group)")
    ap.add_argument("--rounds", type=int, default=3, help="--group: interleaved rounds (each figure their median)")
    ap.add_argument("--layers", type=int, default=4, help="--group: decoder layers of the 30B-A3B shape")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.group:
        from .moe_group import run_group

        run_group(args.layers, args.rounds, [int(v) for v in args.batch.split(",")], args.prompt_len,
                  args.new_tokens, args.out, args.size)
        return
    if args.checkpoint and args.triton:
        triton_stream(args.checkpoint, kv_cache_memory=args.kv_cache_memory)
        return
    if args.checkpoint:
        engine_decode(args.checkpoint, [int(v) for v in args.batch.split(",")], kv_cache_memory=args.kv_cache_memory)
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
