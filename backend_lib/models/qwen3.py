"""Qwen3 decoder (pre-norm, GQA, q/k-norm, rotate-half RoPE, SwiGLU) over backend_lib.kernels: the dense model
and Qwen3-MoE, whose sparse layers replace the MLP by routed experts (layers/moe.py).

Tokens of all sequences in a step are flattened into one [T, hidden] batch; the paged KV cache and
AttentionMetadata say which sequence each token belongs to.
"""
from __future__ import annotations

import logging
import time

import torch
from torch import nn

from ..checkpoint import ModelConfig, QuantScheme, WeightStore
from ..device import trim_host_memory
from ..kernels import Kernels
from ..layers.attention import Qwen3Attention
from ..layers.linear import (FLOAT_DTYPES, INT4A8_KERNELS, A8W8Linear, FloatLinear, W4A16Linear, load_linear,
                             make_head)
from ..layers.mlp import Qwen3MLP
from ..layers.moe import Qwen3SparseMoe, load_sparse_moe
from .qwen3_layer_loop import LayerLoop

log = logging.getLogger(__name__)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, attn: Qwen3Attention, mlp: Qwen3MLP | Qwen3SparseMoe, input_norm, post_norm, eps: float, kernels: Kernels):
        super().__init__()
        self.self_attn, self.mlp = attn, mlp
        self.input_layernorm = nn.Parameter(input_norm, requires_grad=False)
        self.post_attention_layernorm = nn.Parameter(post_norm, requires_grad=False)
        self.eps, self.kernels = eps, kernels

    def forward(self, x, residual, positions, cos_sin, kv_cache, meta):
        if residual is None:
            residual = x
            h = self.kernels.rms_norm(x, self.input_layernorm, self.eps)
        else:
            h, residual = self.kernels.add_rms_norm(x, residual, self.input_layernorm, self.eps)
        h = self.self_attn.forward(h, positions, cos_sin, kv_cache, meta)
        h, residual = self.kernels.add_rms_norm(h, residual, self.post_attention_layernorm, self.eps)
        return self.mlp.forward(h), residual


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, embed: torch.Tensor | None, layers: list[Qwen3DecoderLayer],
                 norm: torch.Tensor, lm_head: FloatLinear | A8W8Linear | W4A16Linear, max_positions: int, kernels: Kernels):
        """embed None: the embedding is tied to lm_head and read from its (packed) weight."""
        super().__init__()
        self.cfg, self.kernels = cfg, kernels
        self.embed_tokens = None if embed is None else nn.Parameter(embed, requires_grad=False)
        self.layers = nn.ModuleList(layers)
        self.norm = nn.Parameter(norm, requires_grad=False)
        self.lm_head = lm_head
        self.register_buffer("cos_sin", cfg.rope.cos_sin(cfg.head_dim, max_positions, norm.device),
                             persistent=False)
        # the layers as one C++ call where it computes exactly what the loop below does (models/qwen3_layer_loop.py);
        # False: always the Python loop (the reference of behaviour)
        self.use_layer_loop = True
        self.layer_loop = LayerLoop(self)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is None:
            return self.lm_head.rows(input_ids)
        return self.embed_tokens.index_select(0, input_ids)

    def in_layer_loop(self, kv_cache) -> bool:
        """Whether a step over kv_cache runs as one C++ call (models/qwen3_layer_loop.py), forward and forward_aux
        alike."""
        return self.use_layer_loop and self.layer_loop.applies(kv_cache)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache, meta) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of the step's tokens."""
        x = self.embed(input_ids)
        if self.in_layer_loop(kv_cache):
            return self.layer_loop(x, positions, kv_cache, meta)
        residual = None
        # .forward, not __call__: the decoder's ~200 module calls a step each cost ~4.5 us in nn.Module's hook
        # machinery (~0.9 ms of a ~21 ms batch-1 step, bench.step_profile's "Python"); no hooks are used here
        for layer in self.layers:
            x, residual = layer.forward(x, residual, positions, self.cos_sin, kv_cache, meta)
        h, _ = self.kernels.add_rms_norm(x, residual, self.norm, self.cfg.rms_norm_eps)
        return h

    def forward_aux(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache, meta,
                    aux_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """[spec] forward(), also returning the residual stream entering each layer of aux_layers (EAGLE-3's
        auxiliary hidden states: 0 is the embeddings, len(layers) the last layer's output before the final norm),
        [T, len * hidden]. Through the C++ layer loop where forward() takes it (it writes the states itself), else
        the Python loop below (the reference: the same bits, tests/test_layer_loop.py)."""
        x = self.embed(input_ids)
        if self.in_layer_loop(kv_cache):
            aux = torch.empty((x.shape[0], len(aux_layers) * x.shape[1]), dtype=x.dtype, device=x.device)
            return self.layer_loop(x, positions, kv_cache, meta, aux, aux_layers), aux
        residual = None
        caps: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                caps[i] = x.clone() if residual is None else x + residual
            x, residual = layer.forward(x, residual, positions, self.cos_sin, kv_cache, meta)
        if len(self.layers) in aux_layers:
            caps[len(self.layers)] = x + residual
        h, _ = self.kernels.add_rms_norm(x, residual, self.norm, self.cfg.rms_norm_eps)
        return h, torch.cat([caps[i] for i in aux_layers], dim=-1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [n, vocab] of the given hidden rows."""
        return self.lm_head(hidden, torch.float32)

    @classmethod
    def from_checkpoint(cls, store: WeightStore, cfg: ModelConfig, scheme: QuantScheme | None, dtype: torch.dtype,
                        device: torch.device, kernels: Kernels, max_positions: int,
                        lm_head_quant: str = "checkpoint", greedy_head: str = "off",
                        moe_experts_quant: str = "checkpoint",
                        int4_activations: str = "checkpoint") -> "Qwen3ForCausalLM":
        """lm_head_quant: 'checkpoint' (the head as the checkpoint stores it), 'int8', 'int4' or 'int4a8' (quantized at
        load: layers/linear.py make_head; a tied embedding then keeps its own float rows). greedy_head 'int8': the
        checkpoint's head with an int8 screen of its greedy rows (layers/greedy_head.py). moe_experts_quant:
        'checkpoint' or 'int4a8' (a Qwen3-MoE's routed experts as int4 codes on int8 activations, layers/moe.py).
        int4_activations: 'checkpoint' or 'int8' (an int4 checkpoint's attention projections and dense MLPs on
        int8 activations, layers/linear.py load_linear; the routed experts follow moe_experts_quant)."""
        if moe_experts_quant != "checkpoint" and cfg.moe is None:
            raise ValueError(f"moe_experts_quant: {moe_experts_quant} applies to Qwen3-MoE checkpoints; this one "
                             "is a dense Qwen3 (use checkpoint)")
        if int4_activations != "checkpoint" and (scheme is None or scheme.kind != "w4a16"):
            raise ValueError(f"int4_activations: {int4_activations} applies to int4 (W4A16, GPTQ, AWQ) checkpoints;"
                             f" this one is {scheme.kind if scheme else 'float'} (use checkpoint)")
        for name, value in (("moe_experts_quant", moe_experts_quant), ("int4_activations", int4_activations)):
            if value != "checkpoint" and kernels.name not in INT4A8_KERNELS:   # the sets with the w4a8 arithmetic
                raise ValueError(f"{name}: {value} runs on the {' and '.join(INT4A8_KERNELS)} kernel sets; this engine"
                                 f" runs {kernels.name!r}")
        t0 = time.time()
        hid, d = cfg.hidden_size, cfg.head_dim
        h, kvh, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size

        def dense(name, shape, keep=True):
            """keep: a copy the model holds (a view into the checkpoint would keep its whole mapping resident);
            otherwise possibly a view, for weights the kernels repack anyway (no transient copy)."""
            return store.get(name, shape, FLOAT_DTYPES).to(device=device, dtype=dtype, copy=keep).contiguous()

        # The head first, while little else is resident: packing it holds the raw weight and its packed form
        # at once, and with tied embeddings that is the largest tensor of a small model.
        def head(name):
            w = dense(name, (cfg.vocab_size, hid), keep=False)
            return make_head(w, kernels, lm_head_quant, greedy_head)

        if store.has("lm_head.weight"):
            if scheme is not None and scheme.is_quantized("lm_head"):
                raise ValueError("quantization_config: a quantized lm_head is not supported; add it to 'ignore'")
            lm_head = head("lm_head.weight")
            store.release()
            embed = dense("model.embed_tokens.weight", (cfg.vocab_size, hid))
        elif cfg.tie_word_embeddings:
            lm_head = head("model.embed_tokens.weight")
            # a float head holds the embedding (read from its packed weight, never held twice); an int8 one
            # does not: the embedding rows are the checkpoint's, not the quantized head's
            embed = None if isinstance(lm_head, FloatLinear) else dense("model.embed_tokens.weight", (cfg.vocab_size, hid))
        else:
            from ..checkpoint import CheckpointError
            raise CheckpointError("checkpoint is missing tensor 'lm_head.weight' (tie_word_embeddings is false)")
        store.release()
        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}"
            qkv = load_linear(store, [f"{p}.self_attn.{n}_proj" for n in "qkv"], [h * d, kvh * d, kvh * d], hid,
                              scheme, dtype, device, kernels, int4_activations)
            o = load_linear(store, [f"{p}.self_attn.o_proj"], [hid], h * d, scheme, dtype, device, kernels,
                            int4_activations)
            attn = Qwen3Attention(i, qkv, o, dense(f"{p}.self_attn.q_norm.weight", (d,)),
                                  dense(f"{p}.self_attn.k_norm.weight", (d,)), h, kvh, d, cfg.rms_norm_eps, kernels)
            if cfg.is_moe_layer(i):
                mlp = load_sparse_moe(store, f"{p}.mlp", hid, cfg.moe, scheme, dtype, device, kernels,
                                      experts_quant=moe_experts_quant)
            else:
                gate_up = load_linear(store, [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"], [inter, inter], hid,
                                      scheme, dtype, device, kernels, int4_activations)
                down = load_linear(store, [f"{p}.mlp.down_proj"], [hid], inter, scheme, dtype, device, kernels,
                                   int4_activations)
                mlp = Qwen3MLP(gate_up, down, kernels)
            layers.append(Qwen3DecoderLayer(attn, mlp,
                                            dense(f"{p}.input_layernorm.weight", (hid,)),
                                            dense(f"{p}.post_attention_layernorm.weight", (hid,)),
                                            cfg.rms_norm_eps, kernels))
            store.release()   # this layer's pages of the checkpoint leave the process as it goes
            # and so do its freed transients (int4 codes one per byte, scales, fused copies: a few MB each):
            # once glibc's dynamic mmap threshold has risen past their size it serves them from its heap and keeps
            # the freed pages resident, so the peak grew with the layers (a 4-layer 30B-A3B W4A16 checkpoint:
            # 8.02 GiB peak for 2.80 GiB after load; 3.11 GiB with this trim; the 48 layers outgrew 24 GB)
            trim_host_memory()
            log.info("loading weights: layer %d/%d (%.1fs)", i + 1, cfg.num_layers, time.time() - t0)
        norm = dense("model.norm.weight", (hid,))
        store.release()
        model = cls(cfg, embed, layers, norm, lm_head, max_positions, kernels)
        log.info("loaded %d layers (%s weights, %s compute) in %.1fs", cfg.num_layers,
                 scheme.describe() if scheme else "float", dtype, time.time() - t0)
        return model
