"""Decode speed through the real tritonserver (client load generator) against the in-process engine."""
from __future__ import annotations

import asyncio
import statistics
import tempfile
from pathlib import Path

from backend_lib.serving.server_process import TritonServer, make_repository
from bench.workers.common import prompts
from client.loadgen import run_load


def triton_decode(checkpoints: dict[str, Path], repeats: int = 3, new_tokens: int = 128) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-triton-") as tmp:
        repo = make_repository(Path(tmp) / "models", {
            "qwen3_a8w8": {"checkpoint": str(checkpoints["a8w8"]), "kv_cache_memory": "4GiB", "max_model_len": "2048",
                           "max_num_seqs": "16"}})
        server = TritonServer(repo, Path(tmp) / "tritonserver.log").start(timeout=600)
        try:
            for concurrency in (1, 16):
                ps = prompts(concurrency, 128)
                reqs = [{"input_ids": p, "stream": True, "max_tokens": new_tokens,
                         "sampling_parameters": {"temperature": 0, "ignore_eos": True}} for p in ps]
                asyncio.run(run_load(server.grpc_url, "qwen3_a8w8", concurrency, reqs[:1]))   # warm-up
                runs = [asyncio.run(run_load(server.grpc_url, "qwen3_a8w8", concurrency, reqs)) for _ in range(repeats)]
                itl = statistics.median(r["inter_token_latency_s"]["avg"] for r in runs)
                ttft = statistics.median(r["time_to_first_token_s"]["avg"] for r in runs)
                errors = sum(r["errors"] for r in runs)
                rows.append({"system": "triton", "weights": "a8w8", "kv_cache": "bf16", "mode": "decode",
                             "batch": concurrency, "prompt_len": 128, "new_tokens": new_tokens,
                             "decode_tokens_per_s": concurrency / itl, "ttft_s": ttft, "errors": errors})
        finally:
            server.stop()
    return rows
