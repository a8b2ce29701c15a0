"""One layer's paged attention on the compiled CPU kernels, dense bf16 and TurboQuant KV (Qwen3-0.6B shapes:
16 query heads, 8 KV heads, head_dim 128, pages of 128 tokens; random caches).

    python -m bench.attention [--context 1024 4096] [--chunk 512]

Prefill: a prompt of `context` tokens in chunks of `chunk` (as the engine's max_num_batched_tokens splits
it), total time per layer and GFLOP/s of the causal attention; decode: one token at that context, ms per
layer and the KV bytes it reads per second. Kernel figures to see where a first token's time goes, not
system comparisons (those are `python -m bench.run`).
"""
from __future__ import annotations

import argparse
import time

import torch

H, KVH, D, S = 16, 8, 128, 128


def _timed(fn, repeats: int = 1) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--chunk", type=int, default=512)
    args = ap.parse_args(argv)
    from backend_lib.kernels import get_kernels

    k = get_kernels(torch.device("cpu"))
    torch.manual_seed(0)
    rotation = torch.linalg.qr(torch.randn(D, D))[0].contiguous()
    cents = torch.linspace(-0.2, 0.2, 16)
    for L in args.context:
        pages = -(-L // S)
        dense = (torch.randn(pages, KVH, S // 32, D, 32).bfloat16(), torch.randn(pages, KVH, S, D).bfloat16())
        tq = (torch.randint(0, 256, (pages, KVH, S // 32, D // 2, 32), dtype=torch.uint8), torch.rand(pages, KVH, S),
              torch.randint(0, 256, (pages, KVH, S, D // 2), dtype=torch.uint8), torch.rand(pages, KVH, S))
        table = torch.arange(pages, dtype=torch.int32)[None]
        attend = {"bf16 KV": lambda q, qsl, lens: k.paged_attention(q, *dense, table, qsl, lens, D ** -0.5),
                  "TQ KV": lambda q, qsl, lens: k.tq_paged_attention(q, *tq, table, qsl, lens, rotation, cents,
                                                                     D ** -0.5)}
        flops = H * L * L / 2 * D * 4
        for name, fn in attend.items():
            total = 0.0
            for c0 in range(0, L, args.chunk):
                n = min(args.chunk, L - c0)
                q = torch.randn(n, H, D).bfloat16()
                qsl, lens = torch.tensor([0, n], dtype=torch.int32), torch.tensor([c0 + n], dtype=torch.int32)
                total += _timed(lambda: fn(q, qsl, lens))
            q = torch.randn(1, H, D).bfloat16()
            step = _timed(lambda: fn(q, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([L], dtype=torch.int32)),
                          repeats=10)
            kv_bytes = pages * KVH * S * (D * 4 if name == "bf16 KV" else D + 8)
            print(f"{L:>6} tokens, {name:7}: prefill {total * 1000:8.1f} ms per layer ({flops / total / 1e9:5.1f} "
                  f"GFLOP/s); decode {step * 1000:6.2f} ms per layer ({kv_bytes / step / 1e9:5.1f} GB/s of KV)",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
