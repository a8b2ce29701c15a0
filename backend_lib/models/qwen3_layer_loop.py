"""The decoder's layers as one C++ call (`torch.ops.qwen3_cpu.decode_layers`, kernels/cpu/csrc/decode_layers.cpp).

The compiled op runs the same kernel functions as the Python layers, in the same order, so its hidden states
are bit-identical to Qwen3ForCausalLM's Python loop (the reference of behaviour, tests/test_layer_loop.py);
it only removes the interpreter between ~200 kernel calls a step. It applies where that path would compute
nothing else: the `cpu` kernel set, every projection a plain A8W8Linear, a W4A16Linear (GPTQ act-order ones
included: the op gathers each row by the linear's perm as w4a16_linear does), a W4A8Linear (`int4_activations:
int8`: w4a8_linear) or a FloatLinear (bf16 / fp32 weights in float_pack's panels: float_linear) (each linear of its
own kind, as the checkpoint has it), a dense KV cache;
Qwen3-MoE's sparse layers (layers/moe.py) where the router is a FloatLinear, the routing layers/moe.py's route() and
the experts float, A8W8, W4A16 (act-order ones included, a perm per expert weight) or W4A8 in the set's native op
(kernels/cpu/moe.py's table_of, the table the Python layer uses). Anything else (projections whose act-order perms
differ, so that they stay a ConcatLinear of several W4A16Linears, experts the native op does not take, TurboQuant,
linears wrapped with per-row features, expert parallelism) takes the Python loop. With `aux` the op also writes EAGLE-3's aux hidden states ([spec],
Qwen3ForCausalLM.forward_aux), in the region and op by op alike.

The op takes them as one `torch.classes.qwen3_cpu.LayerPack` (the layers' list, the KV cache's K and V tensors, the
final norm), built once per KV cache: a list of ~650 tensors converted by torch.ops at every step cost ~0.45 ms of it.
Per layer the pack's list holds the four norms, each linear's first three prepared tensors (A8W8: packed, scale,
colsum; W4A16: packed, scales, zeros; W4A8: packed, scales and an empty tensor; float: packed and two empty
tensors), then each linear's column permutation
(a W4A16Linear's act-order perm, int64 [K]; else empty), and last a float64 [4, 2]: per linear
(qkv, o, gate_up, down) its output width and its W4A16 lut_zero (-1 for A8W8 and float, or no batch-1 table
lookup). A sparse layer's MLP slots: the router's
packed weight, the experts' table and lut, its dims (moe_experts' six, then top_k and norm_topk_prob, int64),
two empty tensors, and empty perms for gate_up and down (the experts' perms are in the table; csrc/decode_layers.cpp,
kMoeDims).
"""
from __future__ import annotations

import torch

from ..kv_cache.dense import DenseKVCache
from ..kernels.cpu.moe import A8W8, FLOAT, W4A16, W4A8, table_of
from ..layers.linear import A8W8Linear, FloatLinear, W4A8Linear, W4A16Linear
from ..layers.mlp import Qwen3MLP
from ..layers.moe import Qwen3SparseMoe


class LayerLoop:
    """Holds the layers' tensors in the op's order (references to the layers' own, no copies)."""

    def __init__(self, model):
        self.model = model
        self.layers: list[torch.Tensor] | None = None
        self.linears_ok: bool | None = None
        self.pack: tuple[object, object] | None = None   # (the KV cache, its torch.classes.qwen3_cpu.LayerPack)
        attn = model.layers[0].self_attn if len(model.layers) else None
        self.heads = (attn.num_heads, attn.num_kv_heads, attn.eps, attn.scale) if attn is not None else None

    def _linears(self, layer):
        dense = (layer.mlp.gate_up_proj, layer.mlp.down_proj) if type(layer.mlp) is Qwen3MLP else ()
        return (layer.self_attn.qkv_proj, layer.self_attn.o_proj) + dense

    @staticmethod
    def _linear_ok(lin) -> bool:
        """A plain A8W8Linear, a W4A16Linear (with or without a GPTQ act-order perm), a W4A8Linear or a FloatLinear
        in the CPU set's forms (float_pack panels; w4a16_pack'ed codes)."""
        if type(lin) is A8W8Linear:
            return len(lin.prepared) == 3
        if type(lin) is W4A8Linear:
            packed = lin.prepared[0]
            return isinstance(packed, torch.Tensor) and packed.dtype == torch.int32 and packed.dim() == 3
        if type(lin) is FloatLinear:
            return isinstance(lin.prepared[0], torch.Tensor) and lin.prepared[0].dim() == 4
        return type(lin) is W4A16Linear and lin.prepared[4] == lin.out_features

    @staticmethod
    def _sparse_ok(mlp) -> bool:
        """A sparse layer the op computes as the Python layer does: route() on a FloatLinear router's logits, the
        float, A8W8, W4A16 or W4A8 experts through the CPU set's native op (its table)."""
        if mlp.kernels.moe_route is not None or type(mlp.gate) is not FloatLinear or mlp.gate.prepared[0].dim() != 4:
            return False
        table = table_of(mlp.moe_weights)
        return table is not None and table.dims[0] in (FLOAT, A8W8, W4A16, W4A8)

    def applies(self, kv_cache) -> bool:
        if self.model.kernels.name != "cpu" or self.heads is None or type(kv_cache) is not DenseKVCache:
            return False
        if self.linears_ok is None:   # the projections are fixed at load
            self.linears_ok = all(
                (type(layer.mlp) is Qwen3MLP or (type(layer.mlp) is Qwen3SparseMoe and self._sparse_ok(layer.mlp)))
                and all(self._linear_ok(lin) for lin in self._linears(layer))
                for layer in self.model.layers)
        return self.linears_ok

    @staticmethod
    def _sparse_tensors(mlp) -> list[torch.Tensor]:
        table = table_of(mlp.moe_weights)
        dims = torch.tensor(list(table.dims) + [mlp.top_k, int(mlp.norm_topk_prob)], dtype=torch.int64)
        empty = torch.empty(0)
        return [mlp.gate.prepared[0], table.table, table.lut, dims, empty, empty]

    def _layer_tensors(self) -> list[torch.Tensor]:
        if self.layers is None:
            flat = []
            for layer in self.model.layers:
                a = layer.self_attn
                flat += [layer.input_layernorm, layer.post_attention_layernorm, a.q_norm, a.k_norm]
                lin_dims = [0.0, -1.0] * 4   # per linear: N, W4A16 lut_zero (csrc/decode_layers.cpp, kLinDims)
                perms = [torch.empty(0, dtype=torch.int64)] * 4   # per linear: its act-order perm (kQkvPerm)
                for j, lin in enumerate(self._linears(layer)):
                    if type(lin) is FloatLinear:   # the packed panels (prepared: packed, N, K)
                        flat += [lin.prepared[0], torch.empty(0), torch.empty(0)]
                    elif type(lin) is W4A8Linear:   # prepared: packed, scales, N (its empty third slot marks it)
                        flat += [lin.prepared[0], lin.prepared[1], torch.empty(0)]
                    else:   # A8W8: packed, scale, colsum; W4A16: packed, scales, zeros
                        flat += list(lin.prepared[:3])
                    lin_dims[2 * j] = float(lin.out_features)
                    if type(lin) is W4A16Linear:
                        lin_dims[2 * j + 1] = float(lin.prepared[5])
                        perms[j] = lin.prepared[3]
                if type(layer.mlp) is Qwen3SparseMoe:
                    flat += self._sparse_tensors(layer.mlp)
                flat += perms
                flat.append(torch.tensor(lin_dims, dtype=torch.float64))
            self.layers = [t.detach() for t in flat]
        return self.layers

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv_cache, meta, aux: torch.Tensor | None = None,
                 aux_layers: tuple[int, ...] = ()) -> torch.Tensor:
        """aux ([spec] EAGLE-3, with aux_layers): [T, len(aux_layers) * hidden], written by the op with the residual
        stream entering each of those layers, as Qwen3ForCausalLM.forward_aux's Python loop captures it."""
        m = self.model
        if self.pack is None or self.pack[0] is not kv_cache:   # the op's tensors, handed over as one object a step
            self.pack = (kv_cache, torch.classes.qwen3_cpu.LayerPack(self._layer_tensors(), list(kv_cache.k),
                                                                      list(kv_cache.v), m.norm.detach()))
        h, kvh, eps, scale = self.heads
        return torch.ops.qwen3_cpu.decode_layers(x, self.pack[1], positions, m.cos_sin, meta.slot_mapping,
                                                 meta.block_tables, meta.query_start_loc, meta.seq_lens, h, kvh, eps,
                                                 scale, aux, list(aux_layers))
