"""Builds a demo Qwen3 checkpoint: random weights in a real Qwen3 shape, written in the real formats.

    python -m backend_lib.tools.make_demo_checkpoint OUT [--size tiny|0.6b|tiny-moe|30b-a3b]
        [--format bf16|a8w8|w4a16|gptq|awq] [--group-size N (0: channel-wise)] [--asym] [--desc-act] [--seed N]
        [--layers N] [--task generate|embed] [--stream]

bf16 is a plain transformers safetensors checkpoint; a8w8 goes through compressed-tensors
(W8A8 preset: int8 per-channel weights, dynamic int8 per-token activations, lm_head ignored) exactly
as llmcompressor writes the public *-quantized.w8a8 checkpoints; w4a16 through compressed-tensors too
(pack-quantized int4 weights, as the *-quantized.w4a16 checkpoints); gptq and awq in those layouts
(tools/int4_writers.py). Both carry the real Qwen vocabulary
with Qwen3's special tokens and chat template, and Qwen3's generation_config.json.

The MoE sizes (model_type qwen3_moe: tiny-moe for tests, 30b-a3b in Qwen3-30B-A3B's shapes, `--layers` to keep
fewer of its 48 layers) are written as the published MoE checkpoints are: one tensor per expert
(`model.layers.N.mlp.experts.E.{gate,up,down}_proj`, as transformers' save_pretrained writes them), the routers
`model.layers.N.mlp.gate` and `lm_head` in bf16 and in the quantization config's `ignore` (a8w8, w4a16).
`--stream` writes a MoE size tensor by tensor into sharded safetensors without holding the model (the full
30b-a3b: 61 GB in bf16, ~16 GB in w4a16), random in the stored form (tools/moe_stream_writer.py).
compressed-tensors quantizes nn.Linear modules only and transformers 5 holds the experts as fused 3-D
parameters, so the MoE formats are quantized here, tensor by tensor, in the layout compressed-tensors writes
(int8 `weight` + `weight_scale` [N, 1]; pack-quantized `weight_packed` / `weight_scale` / `weight_shape` /
`weight_zero_point`), with the quantization_config the dense writer's compressor produces.

--task embed writes a Qwen3-Embedding checkpoint instead (bf16 or a8w8): the bare Qwen3Model's tensors (no
`model.` prefix, no lm_head), as sentence-transformers saves it, with its files: modules.json (Transformer,
Pooling, Normalize), 1_Pooling/config.json (last token), config_sentence_transformers.json (Qwen3-Embedding's
query prompt), sentence_bert_config.json, and a tokenizer that appends <|endoftext|> and pads on the left.
A Qwen3-Reranker checkpoint is a plain Qwen3ForCausalLM: the default task's bf16 or a8w8 serves as one.
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger("make_demo_checkpoint")

SIZES = {
    # Qwen3-0.6B's exact shapes.
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, max_position_embeddings=40960),
    # Small enough for tests, same structure (GQA, q/k-norm, tied embeddings, real vocabulary).
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                 # wider random weights than transformers' 0.02, so greedy text does not collapse into one
                 # repeated token and token-for-token comparisons mean something
                 initializer_range=0.2),
    # Qwen3-MoE, tiny: 8 experts of width 32, 2 per token; the dense width serves mlp_only_layers
    "tiny-moe": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, initializer_range=0.2,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[]),
    # Qwen3-30B-A3B's exact shapes (48 layers: --layers keeps fewer)
    "30b-a3b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                    num_key_value_heads=4, head_dim=128, max_position_embeddings=40960, tie_word_embeddings=False,
                    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                    decoder_sparse_step=1, mlp_only_layers=[]),
}
GENERATION_CONFIG = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                     "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95}


def qwen3_config(size: str, **overrides):
    from transformers import Qwen3Config, Qwen3MoeConfig

    fields = dict(vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True,
                  bos_token_id=151643, eos_token_id=151645, hidden_act="silu", attention_bias=False,
                  use_sliding_window=False)
    fields.update(SIZES[size])
    fields.update(overrides)
    if "num_experts" in fields:
        fields.pop("use_sliding_window")
        return Qwen3MoeConfig(**fields)
    return Qwen3Config(**fields)


def random_model(config, seed: int):
    import torch
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    t0 = time.time()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = (Qwen3MoeForCausalLM if config.model_type == "qwen3_moe" else Qwen3ForCausalLM)(config)
    finally:
        torch.set_default_dtype(prev)
    model.eval()
    log.info("initialized %.0fM random parameters in %.1fs", sum(p.numel() for p in model.parameters()) / 1e6,
             time.time() - t0)
    return model


def quantize_a8w8(model) -> object:
    """Applies compressed-tensors' W8A8 scheme with per-channel absmax scales; returns the compressor."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus,
                                                 apply_quantization_config, preset_name_to_scheme)

    qc = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("W8A8", ["Linear"])}, ignore=["lm_head"])
    apply_quantization_config(model, qc)
    with torch.no_grad():
        for _, module in model.named_modules():
            if hasattr(module, "weight_scale"):
                w = module.weight.float()
                scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127.5
                module.weight_scale.copy_(scale.to(module.weight_scale.dtype))
                module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="int-quantized")
    compressor.compress_model(model)
    return compressor


FORMATS = ("bf16", "a8w8", "w4a16", "gptq", "awq")
TASKS = ("generate", "embed")
EMBED_PROMPTS = {"query": "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:",
                 "document": ""}


def write_sentence_transformers(out: Path, hidden_size: int, max_seq_length: int) -> None:
    """Qwen3-Embedding's sentence-transformers files, and its tokenizer's EOS post-processor and left padding."""
    from tokenizers import Tokenizer, processors

    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "2_Normalize").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": hidden_size, "pooling_mode_cls_token": False,
               "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
               "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
               "pooling_mode_lasttoken": True, "include_prompt": True}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    (out / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": EMBED_PROMPTS, "default_prompt_name": None, "similarity_fn_name": "cosine"}, indent=2))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                               "do_lower_case": False}, indent=2))
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eos = "<|endoftext|>"
    tok.post_processor = processors.TemplateProcessing(single=f"$A:0 {eos}:0", pair=f"$A:0 {eos}:0 $B:1 {eos}:1",
                                                       special_tokens=[(eos, tok.token_to_id(eos))])
    tok.save(str(out / "tokenizer.json"))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["padding_side"] = "left"
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


def build(out: str | Path, size: str = "tiny", fmt: str = "bf16", seed: int = 0, overwrite: bool = False,
          group_size: int | None = 32, symmetric: bool = True, desc_act: bool = False, shared_perm: bool = True,
          task: str = "generate", stream: bool = False, **config_overrides) -> Path:
    """group_size (None: channel-wise), symmetric, desc_act: the int4 formats' options (gptq: all three; awq:
    group_size, always asymmetric; w4a16: group_size and symmetric). stream (MoE sizes): tensor by tensor into
    sharded safetensors, random in the stored form, never holding the model (tools/moe_stream_writer.py)."""
    from .qwen_vocab import write_qwen3_tokenizer

    if task not in TASKS:
        raise ValueError(f"--task: {task!r} is not one of {', '.join(TASKS)}")
    if task == "embed" and fmt not in ("bf16", "a8w8"):
        raise ValueError(f"--task embed: --format {fmt} is not offered (bf16 or a8w8)")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} exists and is not empty (use --overwrite)")
        shutil.rmtree(out)
    t0 = time.time()
    log.info("building a %s %s demo checkpoint in %s", size, fmt, out)
    config = qwen3_config(size, **config_overrides)
    if stream and (config.model_type != "qwen3_moe" or task != "generate"):
        raise ValueError("--stream: only the MoE sizes (tiny-moe, 30b-a3b) are written tensor by tensor")
    model = None if stream else random_model(config, seed)
    moe = config.model_type == "qwen3_moe"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=out.parent))
    saved = model.model if task == "embed" and model is not None else model   # an embedding checkpoint: Qwen3Model
    try:
        if stream:
            from .moe_stream_writer import write_streamed

            write_streamed(tmp, config, fmt, group_size, symmetric, seed)
        elif moe and fmt in ("a8w8", "w4a16"):
            model.save_pretrained(tmp)
            del model
            from .moe_writer import quantize_moe_checkpoint

            quantize_moe_checkpoint(tmp, fmt, group_size, symmetric)
        elif fmt == "a8w8":
            compressor = quantize_a8w8(model)
            saved.save_pretrained(tmp)
            compressor.update_config(tmp)
        elif fmt == "w4a16":
            from .int4_writers import quantize_pack_quantized

            compressor = quantize_pack_quantized(model, group_size, symmetric)
            model.save_pretrained(tmp)
            compressor.update_config(tmp)
        elif fmt in ("gptq", "awq"):
            from .int4_writers import write_gptq_or_awq

            model.save_pretrained(tmp)
            write_gptq_or_awq(tmp, fmt, group_size, symmetric, desc_act, seed, shared_perm)
        elif fmt == "bf16":
            saved.save_pretrained(tmp)
        else:
            raise ValueError(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}")
        (tmp / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
        write_qwen3_tokenizer(tmp, config.max_position_embeddings)
        if task == "embed":
            write_sentence_transformers(tmp, config.hidden_size, min(8192, config.max_position_embeddings))
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            out.rmdir()
        tmp.chmod(0o755)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("demo checkpoint ready in %s (%.1fs)", out, time.time() - t0)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--format", choices=FORMATS, default="bf16")
    ap.add_argument("--group-size", type=int, default=32, help="int4 formats: columns per group, 0 channel-wise")
    ap.add_argument("--asym", action="store_true", help="w4a16 / gptq: asymmetric (zero points)")
    ap.add_argument("--desc-act", action="store_true", help="gptq: act-order columns (g_idx)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None, help="keep this many decoder layers (e.g. 30b-a3b for a bench)")
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--task", choices=TASKS, default="generate", help="embed: a Qwen3-Embedding checkpoint")
    ap.add_argument("--stream", action="store_true",
                    help="MoE sizes: write tensor by tensor, random in the stored form (the full 30b-a3b shape)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
        build(args.out, args.size, args.format, args.seed, args.overwrite, args.group_size or None, not args.asym,
              args.desc_act, task=args.task, stream=args.stream, **overrides)
    except (FileExistsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
