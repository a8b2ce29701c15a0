"""Tensor parallel serving: rank 0 is the engine's process (scheduler, sampler, Triton I/O), ranks 1..N-1 are
worker processes it starts and supervises. Each step's inputs reach the workers once, broadcast by rank 0 over
a control group of their own (so an idle server never trips the model group's collective timeout); the
workers run the same sharded forward, whose collectives (parallel/linear.py) meet rank 0's. Only rank 0 holds
the head and samples.

    rank 0                                   rank r (python -m backend_lib.parallel.runtime, env rendezvous)
    ModelRunner -> ShardedModel(...)  ──op──▶ worker_loop: FORWARD -> model(ids, positions, cache, meta)
                   ShardedKVCache.copy_page ─▶           COPY_PAGE -> cache.copy_page(src, dst)
                   close()            ──────▶           STOP -> exit

Faults: a worker that dies makes rank 0's next collective raise (that step's requests fail with an error that
says so, and the engine is marked dead: the model goes not-ready); a worker hung past the model group's
timeout does the same; rank 0 that dies is seen by each worker's parent watch (on one host) and the worker
exits. No rank outlives its server.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from .group import TPGroup, backend_for, shm_slot_bytes

log = logging.getLogger(__name__)

FORWARD, COPY_PAGE, STOP = 1, 2, 3
MODEL_TIMEOUT_S = float(os.environ.get("QWEN3_TP_TIMEOUT_S", "120"))   # a hung rank fails the step after this
IDLE_TIMEOUT = datetime.timedelta(days=365)                           # the control group waits for the next step


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the engine cannot step any more."""
    fatal = True


class StepChannel:
    """Rank 0 -> every worker over the control group: an op header (int64), then the op's tensors, in order."""

    def __init__(self, group: TPGroup, control):
        self.group, self.control = group, control

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, src=0, group=self.control)
        return t


# The step's tensors have fixed dtypes, so only shapes travel: ids, positions, slots (int64), block tables,
# query_start_loc, seq_lens (int32).
STEP_DTYPES = (torch.int64, torch.int64, torch.int64, torch.int32, torch.int32, torch.int32)


def send_step(ch: StepChannel, input_ids, positions, meta) -> None:
    ts = (input_ids, positions, meta.slot_mapping, meta.block_tables, meta.query_start_loc, meta.seq_lens)
    ch._bcast(torch.tensor([FORWARD, *[d for t in ts for d in _shape4(t)]], dtype=torch.int64))
    for t, dtype in zip(ts, STEP_DTYPES):
        ch._bcast(t.to(dtype).contiguous().cpu())


def _shape4(t: torch.Tensor) -> list[int]:
    s = list(t.shape)
    return [len(s), *s, *[0] * (2 - len(s))]


HEADER = 1 + 6 * 3


def recv_op(ch: StepChannel):
    header = ch._bcast(torch.zeros(HEADER, dtype=torch.int64)).tolist()
    op = header[0]
    if op != FORWARD:
        return op, header[1:3]
    ts = []
    for i, dtype in enumerate(STEP_DTYPES):
        n, *dims = header[1 + 3 * i:4 + 3 * i]
        ts.append(ch._bcast(torch.empty(dims[:n], dtype=dtype)))
    return op, ts


def send_simple(ch: StepChannel, op: int, a: int = 0, b: int = 0) -> None:
    ch._bcast(torch.tensor([op, a, b] + [0] * (HEADER - 3), dtype=torch.int64))


class ShardedModel:
    """Rank 0's model: every forward is first broadcast to the workers, then run here; the rest (logits, the
    head, attributes) is rank 0's own."""

    def __init__(self, model, channel: StepChannel, supervisor: "Supervisor"):
        self._model, self._ch, self._sup = model, channel, supervisor

    def __call__(self, input_ids, positions, kv_cache, meta):
        self._sup.check()
        try:
            send_step(self._ch, input_ids, positions, meta)
            return self._model(input_ids, positions, kv_cache, meta)
        except RuntimeError as exc:     # a collective failed: a rank is gone or hung
            raise self._sup.failure(exc) from exc

    def __getattr__(self, name):
        return getattr(self._model, name)


class ShardedKVCache:
    """Rank 0's KV cache: page copies (prefix caching's partial pages) happen on every rank."""

    def __init__(self, cache, channel: StepChannel, supervisor: "Supervisor"):
        self._cache, self._ch, self._sup = cache, channel, supervisor

    def copy_page(self, src: int, dst: int) -> None:
        self._sup.check()
        send_simple(self._ch, COPY_PAGE, src, dst)
        self._cache.copy_page(src, dst)

    def __getattr__(self, name):
        return getattr(self._cache, name)


class Supervisor:
    """Rank 0's view of its workers: their processes, a failure that names the rank, and the shutdown."""

    def __init__(self, procs: list[subprocess.Popen], channel: StepChannel | None = None):
        self.procs, self.channel, self.dead = procs, channel, None

    def check(self) -> None:
        for r, p in enumerate(self.procs, start=1):
            if p.poll() is not None and self.dead is None:
                self.dead = RankFailure(f"tensor parallel rank {r} exited with {p.returncode}")
        if self.dead is not None:
            raise self.dead

    def failure(self, exc: Exception) -> RankFailure:
        time.sleep(0.2)     # a dying worker's exit status is usually there by now
        try:
            self.check()
        except RankFailure as dead:
            return dead
        self.dead = RankFailure(f"tensor parallel: a collective failed or timed out ({exc})")
        return self.dead

    def close(self, timeout_s: float = 5.0) -> None:
        if self.channel is not None and self.dead is None:
            try:
                send_simple(self.channel, STOP)
            except Exception:   # already broken: the kill below ends them
                pass
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()


def _python() -> str:
    """The interpreter for the workers: inside Triton's Python backend sys.executable may be the stub binary."""
    exe = os.path.join(sys.prefix, "bin", "python3")
    return exe if os.path.exists(exe) else sys.executable


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _groups(group: TPGroup):
    """The control group (rank 0's op broadcasts; waits as long as the server idles)."""
    return dist.new_group(list(range(group.size)), timeout=IDLE_TIMEOUT, backend="gloo")


def start(cfg, model_config, scheme, device, dtype, kernels, max_model_len: int):
    """Rank 0: starts ranks 1..N-1 on this host (QWEN3_TP_SPAWN=0: they are started elsewhere, e.g. the workers of a
    LeaderWorkerSet, and join at QWEN3_TP_MASTER_ADDR / QWEN3_TP_MASTER_PORT), joins the group, tells the workers
    max_model_len, loads its shard, sizes the KV pool and tells them its page count.
    Returns (ShardedModel, ShardedKVCache, Supervisor)."""
    from ..checkpoint import WeightStore
    from ..kv_cache import allocate_kv_cache
    from .model import load_sharded

    size = cfg.tensor_parallel_size
    addr = os.environ.get("QWEN3_TP_MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("QWEN3_TP_MASTER_PORT") or _free_port())
    procs = []
    if os.environ.get("QWEN3_TP_SPAWN", "1") != "0":
        payload = json.dumps({k: v for k, v in asdict(cfg).items() if k != "limits"})
        for r in range(1, size):
            env = dict(os.environ, MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(size),
                       QWEN3_TP_PARENT=str(os.getpid()))
            procs.append(subprocess.Popen([_python(), "-m", "backend_lib.parallel.runtime", "--engine-config", payload],
                                          env=env))
    sup = Supervisor(procs)
    try:
        group = TPGroup.init(0, size, addr, port, device, timeout_s=MODEL_TIMEOUT_S)
        control = _groups(group)
        if procs and device.type == "cpu":   # the ranks share this host: collectives through shared memory
            group.enable_shm(f"qwen3-tp-{port}", shm_slot_bytes(cfg.max_num_batched_tokens, model_config.hidden_size),
                             MODEL_TIMEOUT_S)
        dist.broadcast(torch.tensor([max_model_len, *_agreed(cfg)], dtype=torch.int64), src=0)
        model = load_sharded(WeightStore(cfg.checkpoint), model_config, scheme, dtype, device, kernels,
                             max_model_len, group)
        cache = allocate_kv_cache(cfg.kv_cache, model.cfg, dtype, device, kernels, cfg.kv_cache_memory,
                                  cfg.page_size, max_model_len, cfg.max_num_seqs, seed=cfg.tq_seed)
        dist.broadcast(torch.tensor([cache.num_pages], dtype=torch.int64), src=0)   # model group: its timeout
    except Exception:
        sup.close(0.0)
        raise
    ch = StepChannel(group, control)
    sup.channel = ch
    return ShardedModel(model, ch, sup), ShardedKVCache(cache, ch, sup), sup


def _watch_parent(parent: int) -> None:
    """A worker whose rank 0 is gone (on this host) exits at once."""
    while True:
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            os._exit(70)
        if os.getppid() != parent:
            os._exit(70)
        time.sleep(0.5)


# What every rank's configuration must agree on (a worker started from its own config.pbtxt is checked against
# rank 0's at the rendezvous), as integers.
AGREED = ("page_size", "max_num_seqs", "kv_cache", "dtype", "tq_seed")


def _agreed(cfg) -> list[int]:
    import zlib

    return [v if isinstance(v, int) else zlib.crc32(str(v).encode()) for v in (getattr(cfg, n) for n in AGREED)]


PARAMETER = re.compile(r'parameters\s*\{\s*key:\s*"([^"]+)"\s*,?\s*value:\s*\{\s*string_value:\s*"([^"]*)"\s*\}\s*\}')


def config_from_pbtxt(path: str, model: str) -> "EngineConfig":
    """A worker on another host: the engine configuration of the model whose config.pbtxt it is given, with the
    same $<MODEL>_<PARAMETER> overrides the model's own process applies (serving/triton_config.py)."""
    from ..config import EngineConfig

    text = open(path).read()
    params = dict(PARAMETER.findall(text))
    for key in EngineConfig.field_names():
        env = os.environ.get(f"{model.upper()}_{key.upper()}")
        if env:
            params[key] = env
    params.setdefault("device", "cpu")
    if params["device"] in ("", "auto"):
        params["device"] = "cpu"
    return EngineConfig.from_params(params, base_dir=os.path.dirname(os.path.dirname(os.path.abspath(path))))


def worker_main(cfg) -> None:
    from ..checkpoint import ModelConfig, WeightStore, parse_quantization_config
    from ..device import parse_dtype, resolve_device
    from ..kernels import get_kernels
    from ..kv_cache import allocate_kv_cache
    from ..kv_cache.base import cache_class
    from .model import load_sharded

    if os.environ.get("QWEN3_TP_PARENT"):
        threading.Thread(target=_watch_parent, args=(int(os.environ["QWEN3_TP_PARENT"]),), daemon=True).start()
    device = resolve_device(cfg.device)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    dtype = parse_dtype(cfg.dtype, device)
    group = TPGroup.from_env(device, timeout_s=MODEL_TIMEOUT_S)
    if group.size != cfg.tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size: WORLD_SIZE is {group.size}, the model's configuration says "
                         f"{cfg.tensor_parallel_size}")
    control = _groups(group)
    mc = ModelConfig.from_dir(cfg.checkpoint)
    if os.environ.get("QWEN3_TP_PARENT") and device.type == "cpu":   # started by rank 0 on its host
        group.enable_shm(f"qwen3-tp-{os.environ['MASTER_PORT']}",
                         shm_slot_bytes(cfg.max_num_batched_tokens, mc.hidden_size), MODEL_TIMEOUT_S)
    head = torch.zeros(1 + len(AGREED), dtype=torch.int64)
    dist.broadcast(head, src=0)
    max_model_len, *theirs = head.tolist()
    for name, mine, rank0 in zip(AGREED, _agreed(cfg), theirs):
        if mine != rank0:
            raise ValueError(f"tensor parallel rank {group.rank}: {name} differs from rank 0's "
                             f"(this rank's configuration and rank 0's must agree)")
    kernels = get_kernels(device, cfg.kernels, cfg.kernel_cache_dir)
    model = load_sharded(WeightStore(cfg.checkpoint), mc, parse_quantization_config(mc.quantization_config), dtype,
                         device, kernels, max_model_len, group, with_head=False)
    pages = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(pages, src=0)
    per_page = cache_class(cfg.kv_cache).bytes_per_token(model.cfg.num_layers, model.cfg.num_kv_heads,
                                                          model.cfg.head_dim, dtype) * cfg.page_size
    cache = allocate_kv_cache(cfg.kv_cache, model.cfg, dtype, device, kernels, cfg.kv_cache_memory, cfg.page_size,
                              max_model_len, cfg.max_num_seqs, nbytes=int(pages.item()) * per_page,
                              seed=cfg.tq_seed)
    if cache.num_pages != pages.item():
        raise RuntimeError(f"tensor parallel rank {group.rank}: {cache.num_pages} KV pages, rank 0 has {pages.item()}")
    worker_loop(model, cache, StepChannel(group, control))


def worker_loop(model, cache, ch: StepChannel) -> None:
    from ..kv_cache.metadata import AttentionMetadata

    with torch.inference_mode():
        while True:
            op, payload = recv_op(ch)
            if op == FORWARD:
                ids, positions, slots, tables, qsl, lens = payload
                model(ids, positions, cache, AttentionMetadata(slots, tables, qsl, lens))
            elif op == COPY_PAGE:
                cache.copy_page(*payload)
            elif op == STOP:
                return
            else:
                raise RuntimeError(f"tensor parallel worker: unknown op {op}")


def main(argv=None) -> None:
    import argparse

    from ..config import EngineConfig

    ap = argparse.ArgumentParser(description="A tensor-parallel worker rank (RANK, WORLD_SIZE, MASTER_ADDR, "
                                             "MASTER_PORT from the environment).")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine-config", help="JSON of rank 0's EngineConfig (the workers rank 0 starts)")
    src.add_argument("--model-config", help="the model's config.pbtxt (a worker started on another host)")
    ap.add_argument("--model", help="with --model-config: the model's name (for $<MODEL>_<PARAMETER> overrides)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {os.environ.get('RANK')} %(name)s: %(message)s")
    if args.engine_config:
        cfg = EngineConfig(**json.loads(args.engine_config))
    else:
        cfg = config_from_pbtxt(args.model_config, args.model or os.path.basename(os.path.dirname(
            os.path.abspath(args.model_config))))
    worker_main(cfg)


if __name__ == "__main__":
    main()
