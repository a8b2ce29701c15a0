"""LoRA decode cost and cold-adapter latency in process (the issue's figures; no server).

    python -m bench.lora [--size tiny|0.6b] [--format a8w8|bf16] [--checkpoint DIR] [--batch 16] [--adapters 4]
                         [--rank 16] [--tokens 32] [--prompt-len 128]

Decode tokens/s of a batch of `batch` greedy requests on the base model alone, then the same batch spread over
`adapters` distinct rank-`rank` adapters on all seven projections (random A and B in PEFT's file layout), and
the time to first token of a request whose adapter is not resident (its load and validation included).
Prints one JSON object. The adapters are written by this script (no peft needed)."""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

PROJ = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
        "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(folder: Path, mc, rank: int, seed: int) -> Path:
    from safetensors.torch import save_file

    from backend_lib.lora import BaseShape

    shape = BaseShape.of(mc)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(mc.num_layers):
        for proj, parent in PROJ.items():
            key = f"base_model.model.model.layers.{layer}.{parent}.{proj}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, shape.in_features[proj], generator=g) * 0.02).bfloat16()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(shape.out_features[proj], rank, generator=g) * 0.02).bfloat16()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                            "target_modules": list(PROJ), "bias": "none"}))
    return folder


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--format", default="a8w8")
    ap.add_argument("--checkpoint", default=None, help="an existing checkpoint folder (default: a demo one is built)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    args = ap.parse_args(argv)

    from backend_lib.checkpoint import ModelConfig
    from backend_lib.config import EngineConfig
    from backend_lib.engine import LLMEngine
    from backend_lib.tools.make_demo_checkpoint import build

    root = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    ckpt = Path(args.checkpoint) if args.checkpoint else build(root / "ckpt", args.size, args.format, 0)
    mc = ModelConfig.from_dir(ckpt)
    names = [f"a{i}" for i in range(args.adapters)]
    modules = {n: str(write_adapter(root / n, mc, args.rank, i)) for i, n in enumerate(names)}
    cold = write_adapter(root / "cold", mc, args.rank, 99)
    eng = LLMEngine(EngineConfig(checkpoint=str(ckpt), page_size=16, kv_cache_memory="1GiB", max_num_seqs=args.batch,
                                 max_num_batched_tokens=max(512, args.batch), lora_modules=modules,
                                 max_loras=args.adapters + 1, max_lora_rank=args.rank, allow_runtime_lora=True, lora_roots=str(root),
                                 enable_prefix_caching=False))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 150000, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]

    def decode_rate(loras) -> float:
        params = [eng.make_params({"temperature": 0, "ignore_eos": True, "max_tokens": args.tokens,
                                   **({"lora_name": lo} if lo else {})}) for lo in loras]
        for i, (p, sp) in enumerate(zip(prompts, params)):
            eng.add_request(f"r{i}-{time.monotonic_ns()}", p, sp)
        while any(s.num_computed < len(s.prompt_ids) for s in eng.scheduler.running) or eng.scheduler.waiting:
            eng.step()                                   # prefill (not timed)
        t0, n = time.perf_counter(), 0
        while eng.has_unfinished():
            n += sum(len(o.new_token_ids) for o in eng.step())
        return n / (time.perf_counter() - t0)

    decode_rate([None] * args.batch)                     # warm-up
    base = decode_rate([None] * args.batch)
    mixed = decode_rate([names[i % len(names)] for i in range(args.batch)])
    t0 = time.perf_counter()
    eng.generate([prompts[0]], eng.make_params({"temperature": 0, "max_tokens": 1, "lora_name": "cold",
                                                "lora_path": str(cold)}))
    ttft_cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    eng.generate([prompts[0]], eng.make_params({"temperature": 0, "max_tokens": 1, "lora_name": "cold"}))
    ttft_warm = time.perf_counter() - t0
    print(json.dumps({"checkpoint": str(ckpt), "size": args.size, "format": args.format, "batch": args.batch, "adapters": args.adapters,
                      "rank": args.rank, "decode_tokens_per_s_base": round(base, 1),
                      "decode_tokens_per_s_lora": round(mixed, 1), "lora_vs_base": round(mixed / base, 3),
                      "ttft_cold_adapter_s": round(ttft_cold, 4), "ttft_resident_adapter_s": round(ttft_warm, 4),
                      "threads": torch.get_num_threads()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
