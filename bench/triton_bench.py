"""The real tritonserver serving qwen3_a8w8, measured with the client load generator, as a bench "system"."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

from harness.triton_server import TritonServer, make_repository
from bench.workers.common import prompts
from client.loadgen import run_load


class TritonSystem:
    """call(op="decode", batch=B, ...) streams B concurrent requests through gRPC, timed as every bench worker
    times a batch (bench/workers/common.py): the wall time of B requests of N tokens and of B requests of
    one token; decode tokens/s = B (N - 1) / (full - prefill), the same definition for every system."""

    def __init__(self, checkpoint: Path, out_dir: Path, cotenant: Path | None = None, env: dict | None = None,
                 tag: str = ""):
        """cotenant: a checkpoint for qwen3_tq, loaded beside qwen3_a8w8 and left idle (the layout of
        ./scripts/serve.sh: the launcher shares the cores between the two LLM models); env: the server's."""
        models = {"qwen3_a8w8": {"checkpoint": str(checkpoint), "kv_cache_memory": "2GiB", "max_model_len": "1100",
                                 "max_num_seqs": "16"}}
        if cotenant is not None:
            models["qwen3_tq"] = {"checkpoint": str(cotenant), "kv_cache_memory": "1GiB", "max_model_len": "1100",
                                  "max_num_seqs": "16"}
        repo = make_repository(out_dir / f"triton-models{tag}", models)
        self.server = TritonServer(repo, out_dir / f"tritonserver{tag}.log", env=env).start(timeout=600)
        asyncio.run(run_load(self.server.grpc_url, "qwen3_a8w8", 1, [self._request(prompts(1, 16)[0], 2)]))

    @staticmethod
    def _request(ids, max_tokens):
        return {"input_ids": ids, "stream": True, "max_tokens": max_tokens,
                "sampling_parameters": {"temperature": 0, "ignore_eos": True}}

    def _timed(self, batch: int, prompt_len: int, new_tokens: int) -> tuple[float, dict]:
        reqs = [self._request(p, new_tokens) for p in prompts(batch, prompt_len)]
        t0 = time.perf_counter()
        r = asyncio.run(run_load(self.server.grpc_url, "qwen3_a8w8", batch, reqs))
        if r["errors"]:
            raise RuntimeError(f"tritonserver returned errors: {r['error_messages']}")
        return time.perf_counter() - t0, r

    def call(self, op: str, batch: int, prompt_len: int, new_tokens: int) -> dict:
        assert op == "decode"
        full, r = self._timed(batch, prompt_len, new_tokens)
        prefill, _ = self._timed(batch, prompt_len, 1)
        return {"full_s": full, "prefill_s": prefill, "ttft_s": r["time_to_first_token_s"]["avg"],
                "client_itl_s": r["inter_token_latency_s"]["avg"]}

    def close(self) -> None:
        self.server.stop()
