"""Helpers of the Qwen3-MoE tests: checkpoints rewritten in other layouts, the dequantized reference for
transformers, and the per-token int8 activation emulation of transformers' experts."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


def copy_without_weights(src: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name != "model.safetensors.index.json":
            shutil.copy(p, out / p.name)
    return out


def read_all(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for p in sorted(Path(folder).glob("*.safetensors")):
        tensors.update(load_file(str(p)))
    return tensors


def write_single(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})


def dequantized_copy(src: Path, out: Path) -> Path:
    """The checkpoint at `src` (bf16, compressed-tensors W8A8 or pack-quantized) with every weight dequantized
    exactly to fp32 (int8 * scale; int4 (q - zero) * scale) and no quantization_config: what transformers runs
    as the reference of the quantized kernels."""
    from backend_lib.checkpoint import ModelConfig, WeightStore, parse_quantization_config
    from backend_lib.checkpoint.int4 import read_int4

    mc = ModelConfig.from_dir(src)
    scheme = parse_quantization_config(mc.quantization_config)
    store = WeightStore(src)
    tensors = {}
    for name in store.names():
        t = store.get(name)
        if name.endswith(".weight") and t.dtype == torch.int8:
            tensors[name] = t.float() * store.get(name + "_scale").float().reshape(-1, 1)
        elif name.endswith(".weight_packed"):
            module = name.removesuffix(".weight_packed")
            n, k = (int(v) for v in store.get(module + ".weight_shape"))
            tensors[module + ".weight"] = read_int4(store, module, n, k, scheme.int4).dequantize()
        elif name.endswith((".weight_scale", ".weight_shape", ".weight_zero_point", ".weight_g_idx")):
            continue
        else:
            tensors[name] = t.float()
    copy_without_weights(src, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    write_single(out, tensors)
    return out


def fused_expert_copy(src: Path, out: Path, num_layers: int, num_experts: int) -> Path:
    """A float checkpoint with each layer's experts as the fused 3-D tensors of transformers' in-memory layout:
    `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I]."""
    tensors = read_all(src)
    for i in range(num_layers):
        p = f"model.layers.{i}.mlp.experts"
        if f"{p}.0.gate_proj.weight" not in tensors:
            continue
        gu = [torch.cat([tensors.pop(f"{p}.{e}.gate_proj.weight"), tensors.pop(f"{p}.{e}.up_proj.weight")])
              for e in range(num_experts)]
        down = [tensors.pop(f"{p}.{e}.down_proj.weight") for e in range(num_experts)]
        tensors[f"{p}.gate_up_proj"] = torch.stack(gu)
        tensors[f"{p}.down_proj"] = torch.stack(down)
    copy_without_weights(src, out)
    write_single(out, tensors)
    return out


def sharded_copy(src: Path, out: Path, shards: int = 3) -> Path:
    """The checkpoint split into `shards` files with a model.safetensors.index.json, as large models ship."""
    from safetensors.torch import save_file

    tensors = read_all(src)
    names = sorted(tensors)
    copy_without_weights(src, out)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[s::shards]}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def emulate_int8_activations(model):
    """Forward pre-hooks quantizing (and dequantizing) the input of every nn.Linear but lm_head per token, and
    each Qwen3MoeExperts module's forward replaced by transformers' loop with the same emulation before each of
    its two GEMMs (the experts are 3-D parameters, not nn.Linear). Returns the handles to undo it."""
    import torch.nn.functional as F
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from backend_lib.kernels.reference import quantize_per_token

    def fake(x):
        q, s = quantize_per_token(x.reshape(-1, x.shape[-1]))
        return (q.float() * s).reshape(x.shape).to(x.dtype)

    def experts_forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token_idx, top_k_pos = torch.where(top_k_index == e)
            if token_idx.numel() == 0:
                continue
            gate, up = F.linear(fake(hidden_states[token_idx]), self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(fake(self.act_fn(gate) * up), self.down_proj[e])
            out.index_add_(0, token_idx, (y * top_k_weights[token_idx, top_k_pos, None]).to(out.dtype))
        return out

    undo = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            undo.append(mod.register_forward_pre_hook(lambda _m, args: (fake(args[0]),)))
        elif isinstance(mod, Qwen3MoeExperts):
            mod.forward = experts_forward.__get__(mod)
            undo.append(_Restore(mod))
    return undo


class _Restore:
    def __init__(self, mod):
        self.mod = mod

    def remove(self):
        del self.mod.forward


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def load_model(folder, dtype=torch.float32, kernels=None):
    """The model alone (no tokenizer, cache or engine): what the loader's errors need."""
    from backend_lib.checkpoint import ModelConfig, WeightStore, parse_quantization_config
    from backend_lib.kernels import get_kernels
    from backend_lib.models import Qwen3ForCausalLM

    mc = ModelConfig.from_dir(folder)
    return Qwen3ForCausalLM.from_checkpoint(WeightStore(folder), mc, parse_quantization_config(mc.quantization_config),
                                            dtype, torch.device("cpu"), kernels or get_kernels("cpu"), 256)


def moe_block(ckpt: Path, kernels, dtype: torch.dtype, layer: int = 0, experts_quant: str = "checkpoint"):
    """The sparse MLP of `layer` of a MoE checkpoint, loaded on the CPU for `kernels` (the kernel sets' tests);
    experts_quant as EngineConfig.moe_experts_quant."""
    from backend_lib.checkpoint import ModelConfig, WeightStore, parse_quantization_config
    from backend_lib.layers.moe import load_sparse_moe

    mc = ModelConfig.from_dir(ckpt)
    return load_sparse_moe(WeightStore(ckpt), f"model.layers.{layer}.mlp", mc.hidden_size, mc.moe,
                           parse_quantization_config(mc.quantization_config), dtype, torch.device("cpu"), kernels,
                           experts_quant=experts_quant)

