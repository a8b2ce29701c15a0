"""The decoder's layers as one C++ call (`torch.ops.qwen3_cpu.decode_layers`, kernels/cpu/csrc/decode_layers.cpp).

The compiled op runs the same kernel functions as the Python layers, in the same order, so its hidden states
are bit-identical to Qwen3ForCausalLM's Python loop (the reference of behaviour, tests/test_layer_loop.py);
it only removes the interpreter between ~200 kernel calls a step. It applies where that path would compute
nothing else: the `cpu` kernel set, every projection a plain A8W8Linear, a dense KV cache; anything else
(float or int4 weights, TurboQuant, linears wrapped with per-row features, Qwen3-MoE's sparse layers) takes the
Python loop.
"""
from __future__ import annotations

import torch

from ..kv_cache.dense import DenseKVCache
from ..layers.linear import A8W8Linear
from ..layers.mlp import Qwen3MLP


class LayerLoop:
    """Holds the layers' tensors in the op's order (references to the layers' own, no copies)."""

    def __init__(self, model):
        self.model = model
        self.layers: list[torch.Tensor] | None = None
        self.linears_ok: bool | None = None
        self.caches: tuple[object, list[torch.Tensor], list[torch.Tensor]] | None = None
        attn = model.layers[0].self_attn if len(model.layers) else None
        self.heads = (attn.num_heads, attn.num_kv_heads, attn.eps, attn.scale) if attn is not None else None

    def _linears(self, layer):
        return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)

    def applies(self, kv_cache) -> bool:
        if self.model.kernels.name != "cpu" or self.heads is None or type(kv_cache) is not DenseKVCache:
            return False
        if self.linears_ok is None:   # the projections are fixed at load
            self.linears_ok = all(type(layer.mlp) is Qwen3MLP and all(
                type(lin) is A8W8Linear and len(lin.prepared) == 3 for lin in self._linears(layer))
                for layer in self.model.layers)
        return self.linears_ok

    def _layer_tensors(self) -> list[torch.Tensor]:
        if self.layers is None:
            flat = []
            for layer in self.model.layers:
                a = layer.self_attn
                flat += [layer.input_layernorm, layer.post_attention_layernorm, a.q_norm, a.k_norm]
                for lin in self._linears(layer):
                    flat += list(lin.prepared)
            self.layers = [t.detach() for t in flat]
        return self.layers

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv_cache, meta) -> torch.Tensor:
        if self.caches is None or self.caches[0] is not kv_cache:
            self.caches = (kv_cache, list(kv_cache.k), list(kv_cache.v))
        _, k, v = self.caches
        h, kvh, eps, scale = self.heads
        m = self.model
        return torch.ops.qwen3_cpu.decode_layers(x, self._layer_tensors(), k, v, positions, m.cos_sin,
                                                 meta.slot_mapping, meta.block_tables, meta.query_start_loc,
                                                 meta.seq_lens, m.norm.detach(), h, kvh, eps, scale)
