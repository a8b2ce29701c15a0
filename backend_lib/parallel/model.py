"""A Qwen3 decoder sharded across a tensor-parallel group: each rank loads only its rows / columns of every
projection (shard.py), its query heads and KV heads (so its KV cache holds only those heads: the pool grows with
the ranks), its vocabulary rows of the embedding and the head (vocab.py: the logits gathered to rank 0), and
replicates the norms. The layers are the ordinary ones (layers/attention.py, layers/mlp.py) over parallel linears (linear.py);
the one-region decode loop is dense TP = 1 only, so a sharded model runs the per-layer path."""
from __future__ import annotations

import logging
from dataclasses import replace

import torch

from ..checkpoint import CheckpointError, ModelConfig, QuantScheme, WeightStore
from ..kernels import Kernels
from ..layers.attention import Qwen3Attention
from ..layers.linear import FLOAT_DTYPES, A8W8Linear, FloatLinear, make_head
from ..layers.mlp import Qwen3MLP
from ..layers.moe import load_sparse_moe
from ..models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM
from .group import TPGroup
from .linear import RowParallelA8W8, RowParallelFloat
from .moe import ExpertParallelMoe
from .shard import HeadShard, head_rows, shard_heads, split
from .vocab import VocabParallelQwen3, vocab_rows

log = logging.getLogger(__name__)


class _Reader:
    """Reads a projection's weight (and A8W8 scale) as the checkpoint stores it, then the rank's slice."""

    def __init__(self, store: WeightStore, scheme: QuantScheme | None, dtype, device, kernels, group: TPGroup):
        self.store, self.scheme, self.dtype, self.device, self.kernels, self.group = \
            store, scheme, dtype, device, kernels, group

    def quantized(self, name: str) -> bool:
        q = self.scheme is not None and self.scheme.is_quantized(name)
        if q and self.scheme.kind != "a8w8":
            raise CheckpointError(f"tensor_parallel_size > 1: {self.scheme.kind} checkpoints are not sharded yet "
                                  f"(module {name}); A8W8 and float checkpoints are")
        return q

    def _weight(self, name: str, n_out: int, k: int):
        if self.quantized(name):
            w = self.store.get(f"{name}.weight", (n_out, k), (torch.int8,))
            s = self.store.get(f"{name}.weight_scale", None, FLOAT_DTYPES).reshape(-1).float()
            if s.numel() != n_out:
                raise CheckpointError(f"tensor '{name}.weight_scale' has {s.numel()} values, expected {n_out}")
            return w, s
        return self.store.get(f"{name}.weight", (n_out, k), FLOAT_DTYPES), None

    def column(self, parts: list[tuple[str, int, slice]], k: int):
        """The fused projection of parts (name, rows, this rank's rows), column parallel."""
        ws, ss = [], []
        for name, n_out, rows in parts:
            w, s = self._weight(name, n_out, k)
            ws.append(w[rows])
            ss.append(None if s is None else s[rows])
        w = torch.cat(ws).contiguous().to(self.device)
        if ss[0] is not None:
            return A8W8Linear(w, torch.cat(ss).contiguous().to(self.device), self.kernels)
        return FloatLinear(w.to(self.dtype), self.kernels)

    def row(self, name: str, n_out: int, k: int, cols: slice):
        w, s = self._weight(name, n_out, k)
        w = w[:, cols].contiguous().to(self.device)
        if s is not None:
            return RowParallelA8W8(w, s.to(self.device), self.group, self.kernels)
        return RowParallelFloat(w.to(self.dtype), self.group, self.kernels)


def local_config(cfg: ModelConfig, group: TPGroup) -> ModelConfig:
    """The rank's view of the architecture: its heads (the KV cache is sized from it)."""
    s = shard_heads(cfg.num_heads, cfg.num_kv_heads, group.rank, group.size)
    return replace(cfg, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
                   intermediate_size=(cfg.intermediate_size or 0) // group.size)


def load_sharded(store: WeightStore, cfg: ModelConfig, scheme: QuantScheme | None, dtype: torch.dtype,
                 device: torch.device, kernels: Kernels, max_positions: int, group: TPGroup,
                 lm_head_quant: str = "checkpoint") -> Qwen3ForCausalLM:
    """Every rank holds its shard of every layer and its vocabulary rows of the embedding and the head (the
    logits are gathered to rank 0). lm_head_quant as Qwen3ForCausalLM.from_checkpoint's (layers/linear.py
    make_head: each row quantizes on its own, so each rank's rows quantize as TP = 1's)."""
    hid, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    hs: HeadShard = shard_heads(cfg.num_heads, cfg.num_kv_heads, group.rank, group.size)
    rd = _Reader(store, scheme, dtype, device, kernels, group)

    def dense(name, shape):
        return store.get(name, shape, FLOAT_DTYPES).to(device=device, dtype=dtype, copy=True).contiguous()

    def head(w):
        return make_head(w, kernels, lm_head_quant)

    if scheme is not None and scheme.is_quantized("lm_head"):
        raise ValueError("quantization_config: a quantized lm_head is not supported; add it to 'ignore'")
    # vocab parallel (parallel/vocab.py): this rank's rows of the head and of the embedding
    vr = vocab_rows(cfg.vocab_size, group.rank, group.size)

    def rows(name):
        return store.get(name, (cfg.vocab_size, hid), FLOAT_DTYPES)[vr].to(device=device, dtype=dtype,
                                                                           copy=True).contiguous()

    if store.has("lm_head.weight"):
        lm_head = head(rows("lm_head.weight"))
        store.release()
        embed = rows("model.embed_tokens.weight")
    elif cfg.tie_word_embeddings:
        lm_head = head(rows("model.embed_tokens.weight"))
        # a float head holds the embedding; an int8 one does not (the embedding keeps the checkpoint's rows)
        embed = None if isinstance(lm_head, FloatLinear) else rows("model.embed_tokens.weight")
    else:
        raise CheckpointError("checkpoint is missing tensor 'lm_head.weight' (tie_word_embeddings is false)")
    store.release()
    q_rows, kv_rows = head_rows(hs.heads, d), head_rows(hs.kv_heads, d)
    h, kvh = cfg.num_heads, cfg.num_kv_heads
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        qkv = rd.column([(f"{p}.self_attn.q_proj", h * d, q_rows), (f"{p}.self_attn.k_proj", kvh * d, kv_rows),
                         (f"{p}.self_attn.v_proj", kvh * d, kv_rows)], hid)
        o = rd.row(f"{p}.self_attn.o_proj", hid, h * d, q_rows)
        attn = Qwen3Attention(i, qkv, o, dense(f"{p}.self_attn.q_norm.weight", (d,)),
                              dense(f"{p}.self_attn.k_norm.weight", (d,)), hs.num_heads, hs.num_kv_heads, d,
                              cfg.rms_norm_eps, kernels)
        if cfg.is_moe_layer(i):   # expert parallel: whole experts per rank (parallel/moe.py)
            mlp = ExpertParallelMoe(load_sparse_moe(store, f"{p}.mlp", hid, cfg.moe, scheme, dtype, device, kernels,
                                                    owned=lambda e: e % group.size == group.rank), group)
        else:
            f = split(inter, group.rank, group.size, "intermediate_size")
            gate_up = rd.column([(f"{p}.mlp.gate_proj", inter, f), (f"{p}.mlp.up_proj", inter, f)], hid)
            mlp = Qwen3MLP(gate_up, rd.row(f"{p}.mlp.down_proj", hid, inter, f), kernels)
        layers.append(Qwen3DecoderLayer(attn, mlp,
                                        dense(f"{p}.input_layernorm.weight", (hid,)),
                                        dense(f"{p}.post_attention_layernorm.weight", (hid,)),
                                        cfg.rms_norm_eps, kernels))
        store.release()
    norm = dense("model.norm.weight", (hid,))
    model = VocabParallelQwen3(local_config(cfg, group), embed, layers, norm, lm_head, max_positions, kernels,
                               group=group, vocab=cfg.vocab_size)
    model.use_layer_loop = False      # the C++ region has no collectives
    model.cfg_full = cfg              # the whole architecture (LoRA's shards are cut from it)
    log.info("rank %d/%d: heads %s, KV heads %s%s", group.rank, group.size, hs.heads, hs.kv_heads,
             ", experts e % {0} == {1}".format(group.size, group.rank) if cfg.moe is not None else "")
    return model


def load_model(checkpoint: str, dtype: torch.dtype, kernels: Kernels, max_positions: int, group: TPGroup,
               device: torch.device = torch.device("cpu")) -> Qwen3ForCausalLM:
    """The checkpoint's model as this rank computes it: its shard at TP > 1, the whole model at TP = 1 (the check
    tool's and bench.tp's one way to build either)."""
    from ..checkpoint import parse_quantization_config

    cfg = ModelConfig.from_dir(checkpoint)
    scheme = parse_quantization_config(cfg.quantization_config)
    if group.size > 1:
        return load_sharded(WeightStore(checkpoint), cfg, scheme, dtype, device, kernels, max_positions, group)
    return Qwen3ForCausalLM.from_checkpoint(WeightStore(checkpoint), cfg, scheme, dtype, device, kernels,
                                            max_positions)
