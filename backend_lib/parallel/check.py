"""Runs a checkpoint sharded over N ranks (processes on this host, the env rendezvous on 127.0.0.1) and prints
each prompt's greedy ids, alone and in one batch, with a digest of the logits' bits at every step: the tool
that shows TP = N computes what TP = 1 computes.

    python -m backend_lib.parallel.check --checkpoint DIR --tp 2 --prompt-ids 9707,11,1879 --prompt-ids 3,4 --json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import torch


def greedy(model, cache, prompts: list[list[int]], max_tokens: int, page_size: int) -> tuple[list[list[int]], list[str]]:
    """Greedy ids of the prompts run together (one prefill step, then decode steps), and a sha256 of every step's
    fp32 logits rows, per prompt."""
    from ..kv_cache.metadata import AttentionMetadata

    pages_each = -(-(max(map(len, prompts)) + max_tokens) // page_size)
    tables = [list(range(b * pages_each, (b + 1) * pages_each)) for b in range(len(prompts))]
    block_tables = torch.tensor(tables, dtype=torch.int32)
    tokens = [list(p) for p in prompts]
    digests = [hashlib.sha256() for _ in prompts]
    computed = [0] * len(prompts)
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_tokens):
        ids, pos, slots, qsl, lens, last = [], [], [], [0], [], []
        for b, seq in enumerate(tokens):
            new = range(computed[b], len(seq))
            ids += seq[computed[b]:]
            pos += list(new)
            slots += [tables[b][p // page_size] * page_size + p % page_size for p in new]
            qsl.append(qsl[-1] + len(new))
            lens.append(len(seq))
            last.append(qsl[-1] - 1)
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.int64), block_tables,
                                 torch.tensor(qsl, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32))
        with torch.inference_mode():
            hidden = model(torch.tensor(ids), torch.tensor(pos), cache, meta)
            # a sharded model's vocab-parallel head: every rank gets the logits (each picks the same next ids)
            logits = (model.logits(hidden[last], everywhere=True) if getattr(model, "group", None) is not None
                      else model.logits(hidden[last])).float()
        for b, seq in enumerate(tokens):
            digests[b].update(logits[b].numpy().tobytes())
            computed[b] = len(seq)
            t = int(logits[b].argmax())
            seq.append(t)
            out[b].append(t)
    return out, [d.hexdigest()[:16] for d in digests]


def _rank(args) -> dict | None:
    from ..device import parse_dtype
    from ..kernels import get_kernels
    from ..kv_cache import allocate_kv_cache
    from .group import TPGroup
    from .model import load_model

    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    group = TPGroup.from_env(device) if args.tp > 1 else TPGroup()
    if group.size > 1 and not args.no_shm:   # every rank on this host (launch): collectives in shared memory
        from ..checkpoint import ModelConfig
        from .group import shm_slot_bytes

        from .vocab import vocab_share

        tokens = max(map(len, args.prompts)) * len(args.prompts)
        mc = ModelConfig.from_dir(args.checkpoint)
        group.enable_shm(f"qwen3-tp-{os.environ['MASTER_PORT']}",
                         shm_slot_bytes(tokens, mc.hidden_size, logits_rows=len(args.prompts),
                                        vocab_share=vocab_share(mc.vocab_size, group.size)))
    kernels = get_kernels(device, args.kernels)
    max_len = max(map(len, args.prompts)) + args.max_tokens
    page = 16
    result = {"tp": group.size}
    for name in args.dtype.split(","):
        dtype = parse_dtype(name, device)
        model = load_model(args.checkpoint, dtype, kernels, max_len, group)
        if group.size == 1:
            model.use_layer_loop = args.layer_loop
        runs = []
        for _ in range(args.repeat):   # each run on a fresh cache: alone, one prompt at a time, then all batched
            run = {"alone": []}
            for prompt in args.prompts:
                cache = allocate_kv_cache("bf16", model.cfg, dtype, device, kernels, "256MiB", page, max_len, 1)
                run["alone"].append(greedy(model, cache, [prompt], args.max_tokens, page))
            cache = allocate_kv_cache("bf16", model.cfg, dtype, device, kernels, "256MiB", page, max_len,
                                      len(args.prompts))
            run["batched"] = greedy(model, cache, args.prompts, args.max_tokens, page)
            runs.append(run)
        result[name] = runs
        if os.environ.get("QWEN3_TP_DIE_RANK") == str(group.rank):   # the fault tests' hook: die mid-run
            os.kill(os.getpid(), 9)
    group.destroy()
    return result if group.rank == 0 else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv: list[str], tp: int, timeout_s: float = 600.0, module: str = "backend_lib.parallel.check") -> str:
    """Starts tp rank processes (rank 0 prints the result) and returns rank 0's stdout. The first rank to fail
    fails the run naming it, and the others are killed at once (a survivor would wait in its next collective
    until the group's timeout); no rank outlives the run."""
    port = _free_port()
    procs, logs = [], []
    try:
        for r in range(tp):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(tp))
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            logs.append((out, err))
            procs.append(subprocess.Popen([sys.executable, "-m", module, "--rank-process",
                                           *argv], env=env, stdout=out, stderr=err, text=True))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor parallel run: ranks {[r for r, p in enumerate(procs) if p.poll() is None]} "
                                   f"still running after {timeout_s:.0f} s")
            time.sleep(0.05)
        for r, p in enumerate(procs):
            if p.poll() not in (None, 0):
                logs[r][1].seek(0)
                raise RuntimeError(f"rank {r} exited with {p.returncode}:\n{logs[r][1].read()[-4000:]}")
        logs[0][0].seek(0)
        return logs[0][0].read()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for out, err in logs:
            out.close()
            err.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--prompt-ids", action="append", required=True, help="comma-separated ids; repeat for more")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--dtype", default="float32", help="compute dtype(s), comma-separated: float32,bfloat16")
    ap.add_argument("--repeat", type=int, default=1, help="runs per dtype (each on a fresh KV cache)")
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layer-loop", action="store_true", help="TP = 1: the one-region decode loop where it applies")
    ap.add_argument("--no-shm", action="store_true", help="collectives through gloo only (no shared memory)")
    ap.add_argument("--rank-process", action="store_true", help=argparse.SUPPRESS)
    raw = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(raw)
    args.prompts = [[int(t) for t in p.split(",")] for p in args.prompt_ids]
    if args.rank_process or args.tp == 1:
        result = _rank(args)
        if result is not None:
            print(json.dumps(result))
        return
    print(launch([a for a in raw], args.tp), end="")


if __name__ == "__main__":
    main()
