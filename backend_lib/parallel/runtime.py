"""Tensor parallel serving: rank 0 is the engine's process (scheduler, sampler, Triton I/O), ranks 1..N-1 are
worker processes it starts and supervises. Each step's inputs reach the workers once, broadcast by rank 0 over
a control group of their own (so an idle server never trips the model group's collective timeout); the
workers run the same sharded forward, whose collectives (parallel/linear.py) meet rank 0's. Only rank 0 holds
the head and samples.

    rank 0                                   rank r (python -m backend_lib.parallel.runtime, env rendezvous)
    ModelRunner -> ShardedModel(...)  ──op──▶ worker_loop: FORWARD -> model(ids, positions, cache, meta)
                   ShardedModel.forward_aux ──▶          FORWARD (the same: rank 0 reads the aux states)
                   ShardedModel.embed ─────▶            EMBED -> model.embed(ids) (an EAGLE-3 head's rows)
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

from .bind import worker_env
from .channel import StepChannel, word_float
from .group import TPGroup, backend_for, shm_slot_bytes

log = logging.getLogger(__name__)

FORWARD, COPY_PAGE, STOP, LORA_META, LORA_DELTA, LORA_DROP, LOGITS, EMBED = 1, 2, 3, 4, 5, 6, 7, 8
MODEL_TIMEOUT_S = float(os.environ.get("QWEN3_TP_TIMEOUT_S", "120"))   # a hung rank fails the step after this
IDLE_TIMEOUT = datetime.timedelta(days=365)                           # the control group waits for the next step


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the engine cannot step any more."""
    fatal = True


# A step's message: ids, positions, slots (int64), block tables, query_start_loc, seq_lens (int32), and with LoRA
# rows the step's LoRA tensor (parallel/lora.py): one message (parallel/channel.py).
def send_step(ch: StepChannel, input_ids, positions, meta, lora: torch.Tensor | None = None) -> None:
    ts = [input_ids, positions, meta.slot_mapping, meta.block_tables, meta.query_start_loc, meta.seq_lens]
    ch.send(FORWARD, tensors=ts + ([lora] if lora is not None else []))


class ShardedModel:
    """Rank 0's model: every forward is first sent to the workers, then run here; the rest (logits, the head,
    attributes) is rank 0's own. With LoRA on, the step's adapters are sent first (parallel/lora.py)."""

    def __init__(self, model, channel: StepChannel, supervisor: "Supervisor"):
        self._model, self._ch, self._sup = model, channel, supervisor
        self._lora_ctx = self._shipper = None

    def attach_lora(self, ctx, kernels) -> None:
        from .lora import LoraSharder, LoraShipper, attach

        g = self._ch.group
        attach(self._model, ctx, kernels, g)
        self._lora_ctx = ctx
        self._shipper = LoraShipper(LoraSharder(self._model.cfg_full, g, kernels, self._model.norm.device))

    def __call__(self, input_ids, positions, kv_cache, meta):
        return self._step(lambda: self._model(input_ids, positions, kv_cache, meta), input_ids, positions, meta)

    def forward_aux(self, input_ids, positions, kv_cache, meta, aux_layers):
        """[spec] EAGLE-3: (hidden, the aux layers' states [T, len * hidden]) of a step. The workers run the step's
        plain forward (the same message: forward_aux changes no bit of it); the aux states are rank 0's own, read
        from its Python loop: the residual stream entering a layer is the sum of the previous layers' all-reduced
        outputs and the gathered embedding, replicated on every rank, so rank 0's rows are every rank's."""
        return self._step(lambda: self._model.forward_aux(input_ids, positions, kv_cache, meta, aux_layers),
                          input_ids, positions, meta)

    def _step(self, run, input_ids, positions, meta):
        self._sup.check()
        try:
            if self._lora_ctx is None:
                send_step(self._ch, input_ids, positions, meta)
                return run()
            send = lambda op, a=0, b=0, ts=(): self._ch.send(op, a, b, ts)  # noqa: E731
            batch, lora = self._shipper.messages(self._lora_ctx.batch, send)
            send_step(self._ch, input_ids, positions, meta, lora)
            with self._lora_ctx.use(batch):
                return run()
        except RuntimeError as exc:     # a collective failed: a rank is gone or hung
            raise self._sup.failure(exc) from exc

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[spec] The ids' embedding rows, whole (an EAGLE-3 head without embed_tokens reads the target's): every
        rank looks up the ids of its vocabulary rows and they are gathered (parallel/vocab.py), TP = 1's rows."""
        self._sup.check()
        try:
            self._ch.send(EMBED, tensors=(input_ids,))
            return self._model.embed(input_ids)
        except RuntimeError as exc:
            raise self._sup.failure(exc) from exc

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The rows' fp32 logits, gathered here from every rank's vocabulary rows (parallel/vocab.py)."""
        self._sup.check()
        try:
            self._ch.send(LOGITS, tensors=(hidden,))
            return self._model.logits(hidden)
        except RuntimeError as exc:
            raise self._sup.failure(exc) from exc

    def __getattr__(self, name):
        return getattr(self._model, name)


class ShardedKVCache:
    """Rank 0's KV cache: page copies (prefix caching's partial pages) happen on every rank."""

    def __init__(self, cache, channel: StepChannel, supervisor: "Supervisor"):
        self._cache, self._ch, self._sup = cache, channel, supervisor

    def copy_page(self, src: int, dst: int) -> None:
        self._sup.check()
        self._ch.send(COPY_PAGE, src, dst)
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
                self.channel.send(STOP)
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
        from .bind import unbind

        unbind()


def _python() -> str:
    """The interpreter for the workers: inside Triton's Python backend sys.executable may be the stub binary."""
    exe = os.path.join(sys.prefix, "bin", "python3")
    return exe if os.path.exists(exe) else sys.executable


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slot_bytes(cfg, mc, size: int) -> int:
    """The shared-memory slot: a step's partial sums, or a decode step's logits rows of one rank."""
    from .vocab import vocab_share

    return shm_slot_bytes(cfg.max_num_batched_tokens, mc.hidden_size, logits_rows=cfg.max_num_seqs,
                          vocab_share=vocab_share(mc.vocab_size, size))


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
                       LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(size), QWEN3_TP_PARENT=str(os.getpid()),
                       **worker_env())
            procs.append(subprocess.Popen([_python(), "-m", "backend_lib.parallel.runtime", "--engine-config", payload],
                                          env=env))
    sup = Supervisor(procs)
    try:
        group = TPGroup.init(0, size, addr, port, device, timeout_s=MODEL_TIMEOUT_S)
        control = _groups(group)
        if procs and device.type == "cpu":   # the ranks share this host: collectives through shared memory
            group.enable_shm(f"qwen3-tp-{port}", slot_bytes(cfg, model_config, size), MODEL_TIMEOUT_S)
        dist.broadcast(torch.tensor([max_model_len, *_agreed(cfg)], dtype=torch.int64), src=0)
        model = load_sharded(WeightStore(cfg.checkpoint), model_config, scheme, dtype, device, kernels,
                             max_model_len, group, lm_head_quant=cfg.lm_head_quant)
        cache = allocate_kv_cache(cfg.kv_cache, model.cfg, dtype, device, kernels, cfg.kv_cache_memory,
                                  cfg.page_size, max_model_len, cfg.max_num_seqs, seed=cfg.tq_seed)
        dist.broadcast(torch.tensor([cache.num_pages], dtype=torch.int64), src=0)   # model group: its timeout
    except Exception:
        sup.close(0.0)
        raise
    ch = StepChannel(group, control)
    sup.channel = ch
    if group.shm is not None:   # a rank that is gone fails rank 0's wait at once, not after the timeout
        group.shm.alive = sup.check
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
AGREED = ("page_size", "max_num_seqs", "kv_cache", "dtype", "tq_seed", "lora_enabled", "lm_head_quant")


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
    from .bind import bind_rank, host_share

    if device.type != "cpu" or bind_rank(host_share(int(os.environ.get("RANK", "0")), cfg.tensor_parallel_size),
                                         cfg.cpu_cores, cfg.num_threads) is None:
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
                         slot_bytes(cfg, mc, group.size), MODEL_TIMEOUT_S)
    head = torch.zeros(1 + len(AGREED), dtype=torch.int64)
    dist.broadcast(head, src=0)
    max_model_len, *theirs = head.tolist()
    for name, mine, rank0 in zip(AGREED, _agreed(cfg), theirs):
        if mine != rank0:
            raise ValueError(f"tensor parallel rank {group.rank}: {name} differs from rank 0's "
                             f"(this rank's configuration and rank 0's must agree)")
    kernels = get_kernels(device, cfg.kernels, cfg.kernel_cache_dir)
    model = load_sharded(WeightStore(cfg.checkpoint), mc, parse_quantization_config(mc.quantization_config), dtype,
                         device, kernels, max_model_len, group, lm_head_quant=cfg.lm_head_quant)
    pages = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(pages, src=0)
    per_page = cache_class(cfg.kv_cache).bytes_per_token(model.cfg.num_layers, model.cfg.num_kv_heads,
                                                          model.cfg.head_dim, dtype) * cfg.page_size
    cache = allocate_kv_cache(cfg.kv_cache, model.cfg, dtype, device, kernels, cfg.kv_cache_memory, cfg.page_size,
                              max_model_len, cfg.max_num_seqs, nbytes=int(pages.item()) * per_page,
                              seed=cfg.tq_seed)
    if cache.num_pages != pages.item():
        raise RuntimeError(f"tensor parallel rank {group.rank}: {cache.num_pages} KV pages, rank 0 has {pages.item()}")
    lora = None
    if cfg.lora_enabled:   # the adapters' shards arrive from rank 0 (parallel/lora.py)
        from ..lora.layer import LoraContext
        from .lora import LoraReceiver, LoraSharder, attach

        ctx = LoraContext()
        attach(model, ctx, kernels, group)
        lora = (LoraReceiver(LoraSharder(mc, group, kernels, device)), ctx)
    worker_loop(model, cache, StepChannel(group, control), lora)


def worker_loop(model, cache, ch: StepChannel, lora=None) -> None:
    """lora: the worker's LoraReceiver (with the LoraContext its layers read), when LoRA is on."""
    from ..kv_cache.metadata import AttentionMetadata

    with torch.inference_mode():
        while True:
            op, a, b, ts = ch.recv()
            if op == FORWARD:
                ids, positions, slots, tables, qsl, lens = ts[:6]
                meta = AttentionMetadata(slots, tables, qsl, lens)
                if lora is None:
                    model(ids, positions, cache, meta)
                else:
                    receiver, ctx = lora
                    with ctx.use(receiver.batch(ts[6] if len(ts) > 6 else None, ids.device)):
                        model(ids, positions, cache, meta)
            elif op == LOGITS:
                model.logits(ts[0])
            elif op == EMBED:       # [spec] an EAGLE-3 head's embedding rows (ShardedModel.embed)
                model.embed(ts[0])
            elif op == COPY_PAGE:
                cache.copy_page(a, b)
            elif op == LORA_META:
                lora[0].meta(a, word_float(b))
            elif op == LORA_DELTA:
                lora[0].delta(a, b, *ts)
            elif op == LORA_DROP:
                lora[0].drop(a)
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
    # STOP received: the rank's work is done. Leave without the interpreter's teardown, which would run the process
    # group's C++ destructors while rank 0 closes its side of the same connections (a clean-clone CI run saw this
    # worker end with SIGABRT right after STOP, its answers all correct; not reproduced in 4 reruns). Rank 0 ends
    # the group itself (Workers.close).
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
