"""Qwen3-MoE (model_type qwen3_moe): transformers parity, the published checkpoint layouts, the kernel sets' MoE
slot bit for bit, batch invariance, and errors naming the field or tensor."""
from __future__ import annotations

import json

import pytest
import torch

from backend_lib.checkpoint import CheckpointError, ModelConfig, WeightStore, parse_quantization_config
from helpers import make_engine
from moe_helpers import (copy_without_weights, dequantized_copy, emulate_int8_activations, fused_expert_copy,
                         hf_greedy, load_model, moe_block, read_all, sharded_copy, write_single)

PROMPTS = ["Hello, world!", "The quick brown fox jumps over the lazy dog. " * 4, "介绍一下北京故宫",
           "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"]
TEXT = "The quick brown fox jumps over the lazy dog. 敏捷的棕色狐狸跳过了懒狗。 " * 3


def greedy(eng, n=16):
    return eng.make_params({"temperature": 0, "max_tokens": n, "ignore_eos": True})


def hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def check_greedy_equals_transformers(ckpt, hf_folder, n=16, prompts=PROMPTS, **engine_kw):
    eng = make_engine(ckpt, **engine_kw)
    model = hf(hf_folder)
    prompts = [eng.tokenizer.encode(p) for p in prompts]
    results = eng.generate(prompts, greedy(eng, n))
    for ids, res in zip(prompts, results):
        expected = hf_greedy(model, ids, n)
        assert res["output_ids"] == expected
    assert len({t for r in results for t in r["output_ids"]}) > 8, "degenerate test model"
    return eng


# ----- the model against transformers -------------------------------------------------------------------------

def test_config_reads_the_moe_fields(moe_bf16_ckpt):
    mc = ModelConfig.from_dir(moe_bf16_ckpt)
    assert mc.moe is not None and mc.moe.num_experts == 8 and mc.moe.num_experts_per_tok == 2
    assert mc.moe.moe_intermediate_size == 32 and mc.moe.norm_topk_prob and mc.moe.sparse_layers == (0, 1)


def test_greedy_equals_transformers_fp32(moe_bf16_ckpt):
    eng = check_greedy_equals_transformers(moe_bf16_ckpt, moe_bf16_ckpt, 16, PROMPTS[1:])
    from backend_lib.layers.moe import Qwen3SparseMoe

    assert all(isinstance(layer.mlp, Qwen3SparseMoe) for layer in eng.runner.model.layers)


def test_dense_layers_and_unnormalized_routing_equal_transformers(ckpts):
    """mlp_only_layers and decoder_sparse_step keep the dense MLP on their layers; norm_topk_prob false."""
    ckpt = ckpts.get("tiny-moe-mixed", "bf16", "tiny-moe", num_hidden_layers=4, mlp_only_layers=[1],
                     decoder_sparse_step=2, norm_topk_prob=False, num_experts=6, num_experts_per_tok=3)
    mc = ModelConfig.from_dir(ckpt)
    assert mc.moe.sparse_layers == (3,) and not mc.moe.norm_topk_prob
    eng = check_greedy_equals_transformers(ckpt, ckpt, 12, PROMPTS[:2])
    kinds = [type(layer.mlp).__name__ for layer in eng.runner.model.layers]
    assert kinds == ["Qwen3MLP", "Qwen3MLP", "Qwen3MLP", "Qwen3SparseMoe"]


def test_routing_is_transformers_router_including_ties():
    """The router's softmax in fp32, torch.topk's choice among equal probabilities, renormalization and the cast
    back to the model dtype, against transformers' own router module."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from backend_lib.layers.moe import route

    for dtype in (torch.float32, torch.bfloat16):
        for norm in (True, False):
            cfg = Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm)
            router = Qwen3MoeTopKRouter(cfg).to(dtype)
            w = torch.randn(8, 16)
            w[5] = w[2]          # experts 2 and 5 always tie, 6 and 7 too: topk breaks the ties
            w[7] = w[6]
            router.weight.data = w.to(dtype)
            x = torch.randn(32, 16).to(dtype)
            x[:4] = 0            # every expert ties
            logits, weights, ids = router(x)
            got_ids, got_w = route(torch.nn.functional.linear(x, router.weight), 3, norm)
            assert torch.equal(got_ids, ids) and torch.equal(got_w, weights) and got_w.dtype == dtype


# ----- A8W8 and int4 against their dequantized emulations ------------------------------------------------------

def _logprobs(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_a8w8_checkpoint_is_the_published_layout(moe_a8w8_ckpt):
    mc = ModelConfig.from_dir(moe_a8w8_ckpt)
    qc = mc.quantization_config
    assert qc["ignore"] == ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    store = WeightStore(moe_a8w8_ckpt)
    assert store.get("model.layers.1.mlp.experts.7.down_proj.weight").dtype == torch.int8
    assert list(store.get("model.layers.1.mlp.experts.7.down_proj.weight_scale").shape) == [64, 1]
    assert store.get("model.layers.0.mlp.gate.weight").dtype == torch.bfloat16
    scheme = parse_quantization_config(qc)
    assert not scheme.is_quantized("model.layers.0.mlp.gate")
    assert scheme.is_quantized("model.layers.0.mlp.experts.3.up_proj")


def test_a8w8_logprobs_equal_the_dequantized_emulation(moe_a8w8_ckpt, tmp_path):
    model = hf(dequantized_copy(moe_a8w8_ckpt, tmp_path / "deq"))
    eng = make_engine(moe_a8w8_ckpt)
    ids = eng.tokenizer.encode(TEXT)
    weight_only = _logprobs(model, ids)
    undo = emulate_int8_activations(model)
    emulated = _logprobs(model, ids)
    for u in undo:
        u.remove()
    ours = torch.tensor(eng.score(ids)[1:])
    delta = (ours - emulated).abs().mean().item()
    wo_delta = (weight_only - emulated).abs().mean().item()
    print(f"\nMoE A8W8 fp32: mean |delta logprob| vs emulated = {delta:.2e}; weight-only vs emulated = {wo_delta:.2e}")
    assert delta < 1e-3
    assert wo_delta > 10 * delta, "the comparison could not tell missing activation quantization apart"


@pytest.mark.parametrize("fmt", ["w4a16", "gptq", "awq"])
def test_int4_experts_greedy_equal_transformers_on_the_dequantized_weights(ckpts, fmt, tmp_path):
    ckpt = ckpts.get(f"tiny-moe-{fmt}", fmt, "tiny-moe")
    if fmt == "w4a16":
        store = WeightStore(ckpt)
        assert store.get("model.layers.0.mlp.experts.5.gate_proj.weight_packed").dtype == torch.int32
        assert store.get("model.layers.0.mlp.gate.weight").dtype == torch.bfloat16
        ref = dequantized_copy(ckpt, tmp_path / "deq")
    else:
        ref = tmp_path / "deq"
        _dequantize_gptq_awq(ckpt, ref)
    check_greedy_equals_transformers(ckpt, ref, 12, PROMPTS[:2])


def _dequantize_gptq_awq(ckpt, out):
    """GPTQ / AWQ dequantized through the loader's own reader (checkpoint/int4.py is tested on its own against
    the layouts' definitions in tests/test_w4a16.py)."""
    from backend_lib.checkpoint.int4 import read_int4
    from moe_helpers import copy_without_weights

    mc = ModelConfig.from_dir(ckpt)
    scheme = parse_quantization_config(mc.quantization_config)
    store = WeightStore(ckpt)
    tensors = {}
    for name in store.names():
        if name.endswith(".qweight"):
            module = name.removesuffix(".qweight")
            scales = store.get(module + ".scales")
            n = scales.shape[1]
            k = store.get(name).shape[0] * (8 if scheme.int4.format == "gptq" else 1)
            tensors[module + ".weight"] = read_int4(store, module, n, k, scheme.int4).dequantize()
        elif not name.endswith((".qzeros", ".scales", ".g_idx")):
            tensors[name] = store.get(name).float()
    copy_without_weights(ckpt, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(cfg))
    write_single(out, tensors)


# ----- layouts ------------------------------------------------------------------------------------------------

def _weights(model):
    out = []
    for layer in model.layers:
        for gu, down in layer.mlp.expert_pairs:
            out += [gu.prepared[0], down.prepared[0]]
        out.append(layer.mlp.gate.prepared[0])
    return out


def test_fused_3d_experts_and_shards_load_as_per_expert_tensors(moe_bf16_ckpt, tmp_path):
    """The same packed expert weights (bit for bit) from per-expert tensors, fused 3-D tensors and shards."""
    expected = _weights(load_model(moe_bf16_ckpt, torch.bfloat16))
    fused = fused_expert_copy(moe_bf16_ckpt, tmp_path / "fused", 2, 8)
    assert "model.layers.0.mlp.experts.gate_up_proj" in read_all(fused)
    assert len(list((tmp_path / "fused").glob("*.safetensors"))) == 1
    sharded = sharded_copy(moe_bf16_ckpt, tmp_path / "sharded")
    assert len(list(sharded.glob("*.safetensors"))) == 3
    for folder in (fused, sharded):
        got = _weights(load_model(folder, torch.bfloat16))
        assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))


def test_errors_name_the_tensor(moe_bf16_ckpt, moe_a8w8_ckpt, tmp_path):
    def broken(src, name, edit):
        out = copy_without_weights(src, tmp_path / name)
        tensors = read_all(src)
        edit(tensors)
        write_single(out, tensors)
        return out

    missing = broken(moe_bf16_ckpt, "missing", lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        load_model(missing)
    def reshape(t):
        t["model.layers.0.mlp.experts.2.down_proj.weight"] = torch.zeros(64, 31, dtype=torch.bfloat16)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.experts\.2\.down_proj\.weight.*\[64, 31\]"):
        load_model(broken(moe_bf16_ckpt, "shape", reshape))
    def extra(t):
        t["model.layers.0.mlp.experts.8.up_proj.weight"] = torch.zeros(32, 64, dtype=torch.bfloat16)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.experts\.8\.up_proj\.weight.*num_experts"):
        load_model(broken(moe_bf16_ckpt, "extra", extra))
    no_router = broken(moe_bf16_ckpt, "router", lambda t: t.pop("model.layers.0.mlp.gate.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.gate\.weight"):
        load_model(no_router)
    no_scale = broken(moe_a8w8_ckpt, "scale", lambda t: t.pop("model.layers.1.mlp.experts.0.gate_proj.weight_scale"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.0\.gate_proj\.weight_scale"):
        load_model(no_scale)
    fused = fused_expert_copy(moe_bf16_ckpt, tmp_path / "fused", 2, 8)
    def bad_fused(t):
        t["model.layers.0.mlp.experts.down_proj"] = t["model.layers.0.mlp.experts.down_proj"][:7]
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.experts\.down_proj.*\[7, 64, 32\]"):
        load_model(broken(fused, "fused-bad", bad_fused))


@pytest.mark.parametrize("edit,field", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"num_experts": 0}, "num_experts"),
    ({"moe_intermediate_size": None}, "moe_intermediate_size"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"mlp_only_layers": [5]}, "mlp_only_layers"),
    ({"mlp_only_layers": "0"}, "mlp_only_layers"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
    ({"shared_expert_intermediate_size": 128}, "shared_expert_intermediate_size"),
])
def test_config_errors_name_the_field(moe_bf16_ckpt, edit, field):
    cfg = json.loads((moe_bf16_ckpt / "config.json").read_text())
    cfg.pop("num_experts", None)
    cfg["num_experts"] = cfg.pop("num_local_experts", 8)
    cfg.update(edit)
    with pytest.raises(CheckpointError, match=field):
        ModelConfig.from_dicts(cfg)


# Qwen3-30B-A3B's config.json fields (the hub's), and Qwen3-235B-A22B's shape changes
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                 "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
                 "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
                 "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
                 "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
                 "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
                 "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
                 "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
                 "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
                 "use_sliding_window": False, "vocab_size": 151936}


@pytest.mark.parametrize("edit", [{}, {"hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64,
                                       "moe_intermediate_size": 1536, "intermediate_size": 12288}])
def test_the_released_configs_are_accepted(edit):
    cfg = {**QWEN3_30B_A3B, **edit}
    mc = ModelConfig.from_dicts(cfg)
    assert mc.moe.num_experts == 128 and mc.moe.num_experts_per_tok == 8 and mc.moe.norm_topk_prob
    assert mc.moe.sparse_layers == tuple(range(cfg["num_hidden_layers"]))
    assert mc.moe.moe_intermediate_size == cfg["moe_intermediate_size"] and mc.num_kv_heads == 4


def test_all_sparse_model_needs_no_dense_width(moe_bf16_ckpt):
    cfg = json.loads((moe_bf16_ckpt / "config.json").read_text())
    cfg.pop("intermediate_size")
    assert ModelConfig.from_dicts(cfg).moe.sparse_layers == (0, 1)
    cfg["mlp_only_layers"] = [0]
    with pytest.raises(CheckpointError, match="intermediate_size"):
        ModelConfig.from_dicts(cfg)


# ----- the kernel sets' MoE slot: exact, batch invariant -------------------------------------------------------

def _hidden(t=37, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, 64, generator=g).to(dtype)


@pytest.mark.parametrize("fmt,kernel_set", [("bf16", "cpu"), ("a8w8", "cpu"), ("w4a16", "cpu")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_rows_equal_their_solo_runs_bit_for_bit(ckpts, moe_bf16_ckpt, moe_a8w8_ckpt, fmt, kernel_set, dtype):
    from backend_lib.kernels import get_kernels

    ckpt = {"bf16": moe_bf16_ckpt, "a8w8": moe_a8w8_ckpt}.get(fmt) or ckpts.get(f"tiny-moe-{fmt}", fmt, "tiny-moe")
    block = moe_block(ckpt, get_kernels("cpu", kernel_set), dtype)
    x = _hidden(dtype=dtype)
    with torch.inference_mode():
        batched = block.forward(x)
        solo = torch.cat([block.forward(x[i:i + 1]) for i in range(x.shape[0])])
        shuffled = block.forward(x.flip(0)).flip(0)
    assert torch.equal(batched, solo) and torch.equal(batched, shuffled)
    assert batched.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_a8w8_moe_equals_the_reference_bit_for_bit(moe_a8w8_ckpt, dtype):
    from backend_lib.kernels import REFERENCE, get_kernels

    from backend_lib.layers.moe import route

    x = _hidden(dtype=dtype)
    ref_block = moe_block(moe_a8w8_ckpt, REFERENCE, dtype)
    cpu_block = moe_block(moe_a8w8_ckpt, get_kernels("cpu", "cpu"), dtype)
    with torch.inference_mode():
        # one routing for both (the router is a float GEMM, whose summation order is the set's own)
        ids, w = route(ref_block.gate.forward(x), 2, True)
        ref = REFERENCE.moe_experts(x, ids, w, ref_block.expert_pairs)
        cpu = cpu_block.kernels.moe_experts(x, ids, w, cpu_block.expert_pairs)
    assert torch.equal(ref, cpu) and ref.abs().sum() > 0


def _solo_rows(kernels, x, ids, w, block):
    """Each row of x through the set's moe slot alone, concatenated."""
    return torch.cat([kernels.moe_experts(x[i:i + 1], ids[i:i + 1], w[i:i + 1], block.expert_pairs)
                      for i in range(x.shape[0])])


def _all_experts(kernels, x, block, dtype):
    """Every expert at once (k = 8, each of 5 tokens all experts, in shuffled order): the slot's and the composed
    slot's outputs."""
    from backend_lib.kernels.moe import grouped_moe

    ids8 = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(i)) for i in range(5)])
    w8 = torch.softmax(torch.randn(5, 8, generator=torch.Generator().manual_seed(1)), -1).to(dtype)
    return kernels.moe_experts(x[:5], ids8, w8, block.expert_pairs), grouped_moe(kernels, x[:5], ids8, w8,
                                                                                  block.expert_pairs)


@pytest.mark.parametrize("fmt", ["bf16", "a8w8", "w4a16", "w4a16-asym", "gptq-descact"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_native_moe_op_equals_the_composed_slot_bit_for_bit(ckpts, moe_bf16_ckpt, moe_a8w8_ckpt, fmt, dtype):
    """csrc/moe.cpp (one parallel region per MoE layer) against the composed slot (kernels/moe.py) on the same
    routing, batched and alone, every format: the same bits; a routing with ties and repeated experts too.
    gptq-descact: GPTQ act-order experts, each expert's gate_up and down with a perm of its own (the op gathers a
    pair's row by its expert's perms, the composed slot runs each expert's w4a16_linear with its perm)."""
    from backend_lib.kernels import get_kernels
    from backend_lib.kernels.cpu.moe import build_table
    from backend_lib.kernels.moe import grouped_moe
    from backend_lib.layers.moe import route

    cpu = get_kernels("cpu", "cpu")
    if fmt == "w4a16-asym":
        ckpt = ckpts.get("tiny-moe-w4a16-asym", "w4a16", "tiny-moe", symmetric=False)
    elif fmt == "gptq-descact":
        ckpt = ckpts.get("tiny-moe-gptq-descact", "gptq", "tiny-moe", group_size=16, desc_act=True)
    else:
        ckpt = {"bf16": moe_bf16_ckpt, "a8w8": moe_a8w8_ckpt}.get(fmt) or ckpts.get("tiny-moe-w4a16", "w4a16",
                                                                                   "tiny-moe")
    block = moe_block(ckpt, cpu, dtype)
    assert build_table(block.expert_pairs) is not None   # the native op takes this layer
    if fmt == "gptq-descact":   # every expert weight permuted, each by a perm of its own
        perms = [p.prepared[3] for pair in block.expert_pairs for p in pair]
        assert all(p.numel() for p in perms) and len({tuple(p.tolist()) for p in perms}) == len(perms)
    x = _hidden(dtype=dtype)
    with torch.inference_mode():
        ids, w = route(block.gate.forward(x), 2, True)
        native = cpu.moe_experts(x, ids, w, block.expert_pairs)
        composed = grouped_moe(cpu, x, ids, w, block.expert_pairs)
        solo, (all8, all8_composed) = _solo_rows(cpu, x, ids, w, block), _all_experts(cpu, x, block, dtype)
    assert torch.equal(native, composed) and native.abs().sum() > 0
    assert torch.equal(native, solo)
    assert torch.equal(all8, all8_composed)


def test_cpu_native_moe_op_refuses_expert_ids_out_of_range(moe_a8w8_ckpt):
    from backend_lib.kernels import get_kernels

    cpu = get_kernels("cpu", "cpu")
    block = moe_block(moe_a8w8_ckpt, cpu, torch.bfloat16)
    x = _hidden(t=2, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="expert id 8 out of range"):
        cpu.moe_experts(x, torch.tensor([[0, 8], [1, 2]]), torch.ones(2, 2, dtype=torch.bfloat16),
                        block.expert_pairs)


def test_moe_combine_is_transformers_expert_loop(moe_bf16_ckpt):
    """The slot's combine against transformers' Qwen3MoeExperts on the same routing (reference set, fp32): each
    routed expert's output times its weight, added in ascending expert index."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from backend_lib.kernels import REFERENCE
    from backend_lib.layers.moe import route

    block = moe_block(moe_bf16_ckpt, REFERENCE, torch.float32)
    experts = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=64, num_experts=8, moe_intermediate_size=32))
    experts.gate_up_proj.data = torch.stack([gu.prepared for gu, _ in block.expert_pairs])
    experts.down_proj.data = torch.stack([d.prepared for _, d in block.expert_pairs])
    x = _hidden()
    with torch.no_grad():
        ids, w = route(block.gate.forward(x), 2, True)
        ours = block.kernels.moe_experts(x, ids, w, block.expert_pairs)
        theirs = experts(x, ids, w)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("which", ["bf16", "a8w8"])
def test_engine_batched_generation_equals_solo(moe_bf16_ckpt, moe_a8w8_ckpt, which):
    eng = make_engine(moe_bf16_ckpt if which == "bf16" else moe_a8w8_ckpt, dtype="bfloat16")
    prompts = [eng.tokenizer.encode(p) for p in PROMPTS]
    params = greedy(eng, 12)
    solo = [eng.generate([p], params)[0]["output_ids"] for p in prompts]
    assert [r["output_ids"] for r in eng.generate(prompts, params)] == solo


def test_tq_cache_and_prefix_cache_on_moe(moe_a8w8_ckpt):
    """The caches live outside the MLP: TurboQuant and prefix-cache hits give a request its cold ids."""
    prompt = make_engine(moe_a8w8_ckpt).tokenizer.encode(PROMPTS[1])
    for kw in ({"kv_cache": "tq"}, {}):
        eng = make_engine(moe_a8w8_ckpt, dtype="bfloat16", **kw)
        params = greedy(eng, 10)
        cold = eng.generate([prompt], params)[0]["output_ids"]
        assert eng.generate([prompt], params)[0]["output_ids"] == cold


# ----- LoRA on a MoE base -------------------------------------------------------------------------------------

def _adapter(folder, tensors):
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                            "target_modules": ["q_proj", "gate_proj"]}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_lora_expert_adapters_are_refused_naming_the_module(moe_bf16_ckpt, tmp_path):
    from backend_lib.lora import BaseShape, LoraError, load_adapter

    base = BaseShape.of(ModelConfig.from_dir(moe_bf16_ckpt))
    q = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 64),
         "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(128, 4)}
    assert load_adapter("attn", _adapter(tmp_path / "attn", q), base, 16).modules == ("q_proj",)
    expert = "base_model.model.model.layers.1.mlp.experts.3.gate_proj.lora_A.weight"
    with pytest.raises(LoraError, match=rf"{expert.replace('.', '[.]')}.*expert adapters are not supported"):
        load_adapter("e", _adapter(tmp_path / "e", {**q, expert: torch.randn(4, 64)}), base, 16)
    dense = "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"
    with pytest.raises(LoraError, match=rf"{dense.replace('.', '[.]')}.*mixture-of-experts layer"):
        load_adapter("d", _adapter(tmp_path / "d", {dense: torch.randn(4, 64)}), base, 16)


def test_triton_set_a8w8_moe_is_the_reference_and_batch_invariant(moe_a8w8_ckpt):
    """The Triton set's MoE slot (its int8 GEMMs per expert, through the interpreter on the CPU): bit for bit
    the reference's on the same routing, and a row's result alone equals its result in the batch."""
    pytest.importorskip("triton")
    from backend_lib.kernels import REFERENCE, get_kernels
    from backend_lib.layers.moe import route

    tri = get_kernels("cpu", "triton")
    x = _hidden(t=9, dtype=torch.bfloat16)
    ref_block = moe_block(moe_a8w8_ckpt, REFERENCE, torch.bfloat16)
    tri_block = moe_block(moe_a8w8_ckpt, tri, torch.bfloat16)
    with torch.inference_mode():
        ids, w = route(ref_block.gate.forward(x), 2, True)
        got = tri.moe_experts(x, ids, w, tri_block.expert_pairs)
        assert torch.equal(got, REFERENCE.moe_experts(x, ids, w, ref_block.expert_pairs))
        solo = torch.cat([tri.moe_experts(x[i:i + 1], ids[i:i + 1], w[i:i + 1], tri_block.expert_pairs)
                          for i in range(3)])
        assert torch.equal(solo, got[:3])


# ----- the streamed demo writer (the full 30B-A3B shape without holding it) ------------------------------------

@pytest.mark.parametrize("fmt", ["bf16", "a8w8", "w4a16"])
def test_streamed_moe_checkpoint_is_the_published_layout_in_shards(ckpts, moe_bf16_ckpt, moe_a8w8_ckpt, fmt, tmp_path):
    """make_demo_checkpoint --stream (tools/moe_stream_writer.py): the same tensor names, shapes and dtypes and
    the same config as the in-memory writer, across several shards with their index; the engine loads it and
    greedy decoding gives transformers' ids on the bf16 one."""
    from backend_lib.tools.make_demo_checkpoint import qwen3_config
    from backend_lib.tools.moe_stream_writer import write_streamed

    ref = {"bf16": moe_bf16_ckpt, "a8w8": moe_a8w8_ckpt}.get(fmt) or ckpts.get("tiny-moe-w4a16", "w4a16", "tiny-moe")
    out = copy_without_weights(ref, tmp_path / fmt)
    (out / "config.json").unlink()
    write_streamed(out, qwen3_config("tiny-moe"), fmt, group_size=32, shard_bytes=64 * 1024)
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) >= 3
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    a, b = read_all(ref), read_all(out)
    assert sorted(a) == sorted(b) == sorted(index["weight_map"])
    assert all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a)
    assert json.loads((ref / "config.json").read_text()) == json.loads((out / "config.json").read_text())
    if fmt == "bf16":
        check_greedy_equals_transformers(out, out, n=8, prompts=PROMPTS[:2])
    else:
        eng = make_engine(out)
        res = eng.generate([eng.tokenizer.encode(PROMPTS[0])], greedy(eng, 8))
        assert len(res[0]["output_ids"]) == 8


# ----- moe_experts_quant: int4a8 (int4 codes on int8 activations) ----------------------------------------------

def _int4a8_source(ckpts, moe_bf16_ckpt, fmt):
    return moe_bf16_ckpt if fmt == "bf16" else ckpts.get("tiny-moe-w4a16", "w4a16", "tiny-moe")


@pytest.mark.parametrize("fmt", ["w4a16", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4a8_experts_native_op_equals_the_composed_slot_and_the_reference(ckpts, moe_bf16_ckpt, fmt, dtype):
    """`moe_experts_quant: int4a8`: a W4A16 checkpoint's own codes and scales (a bf16 one's quantized at load) as
    W4A8Linear experts; the CPU set's native op (kind W4A8 in csrc/moe_parts.h: the token rows quantized once,
    w4a8_linear's panels) gives the composed slot's bits (each expert's w4a8_linear) on the same routing, batched,
    alone and with every expert routed; each expert's GEMMs give the reference set's (kernels/reference/w4a8.py
    in torch ops: the same integers and fp32 epilogue)."""
    from backend_lib.checkpoint.int4 import read_int4
    from backend_lib.kernels import REFERENCE, get_kernels
    from backend_lib.kernels.cpu.moe import W4A8, build_table
    from backend_lib.kernels.moe import grouped_moe
    from backend_lib.layers.moe import route

    ckpt = _int4a8_source(ckpts, moe_bf16_ckpt, fmt)
    cpu = get_kernels("cpu", "cpu")
    block = moe_block(ckpt, cpu, dtype, experts_quant="int4a8")
    ref_block = moe_block(ckpt, REFERENCE, dtype, experts_quant="int4a8")
    assert all(type(m).__name__ == "W4A8Linear" for pair in block.expert_pairs for m in pair)
    assert type(block.gate).__name__ == "FloatLinear"   # the router stays as stored
    table = build_table(block.expert_pairs)
    assert table is not None and table.dims[0] == W4A8 and table.table.shape[1] == 4
    if fmt == "w4a16":   # the checkpoint's own codes and scales, fused gate then up
        mc = ModelConfig.from_dir(ckpt)
        args = parse_quantization_config(mc.quantization_config).int4
        store, p, inter = WeightStore(ckpt), "model.layers.0.mlp.experts.3", mc.moe.moe_intermediate_size
        gate, up = (read_int4(store, f"{p}.{n}_proj", inter, mc.hidden_size, args) for n in ("gate", "up"))
        codes, scales = ref_block.expert_pairs[3][0].prepared
        assert torch.equal(codes, (torch.cat([gate.codes, up.codes]).to(torch.int16) - 8).to(torch.int8))
        assert torch.equal(scales, torch.cat([gate.scales, up.scales]).float())
    x = _hidden(dtype=dtype)
    with torch.inference_mode():
        ids, w = route(ref_block.gate.forward(x), 2, True)
        native = cpu.moe_experts(x, ids, w, block.expert_pairs)
        composed = grouped_moe(cpu, x, ids, w, block.expert_pairs)
        for (gu, dn), (rgu, rdn) in zip(block.expert_pairs, ref_block.expert_pairs):
            h = gu.forward(x)
            assert torch.equal(h, rgu.forward(x))
            assert torch.equal(dn.forward(h[:, :h.shape[1] // 2]), rdn.forward(h[:, :h.shape[1] // 2]))
        solo, (all8, all8_composed) = _solo_rows(cpu, x, ids, w, block), _all_experts(cpu, x, block, dtype)
        # against the checkpoint's own experts (W4A16 / bf16): close, not equal (int8 activations)
        exact = cpu.moe_experts(x, ids, w, moe_block(ckpt, cpu, dtype).expert_pairs)
    assert torch.equal(native, composed) and native.abs().sum() > 0
    assert torch.equal(native, solo) and torch.equal(all8, all8_composed)
    # the int4 checkpoint's codes: the activations' int8 rounding alone; bf16 experts: the int4 rounding of random
    # weights besides
    err = (native.float() - exact.float()).norm() / exact.float().norm()
    assert 0 < err < (0.03 if fmt == "w4a16" else 0.3)


def test_int4a8_experts_refuse_what_they_cannot_take_naming_the_field(ckpts, bf16_ckpt, moe_a8w8_ckpt):
    """Errors name moe_experts_quant and the tensor: W8A8 experts (int8 codes re-quantized would round twice),
    asymmetric or act-order int4 experts, a dense model, another kernel set, tensor parallel, an unknown value."""
    from backend_lib.config import EngineConfig
    from backend_lib.kernels import get_kernels

    cpu = get_kernels("cpu", "cpu")
    with pytest.raises(ValueError, match=r"moe_experts_quant: int4a8 takes int4 .* 'model\.layers\.0\.mlp\.experts\.0\."
                                         r"gate_proj' is a8w8"):
        moe_block(moe_a8w8_ckpt, cpu, torch.bfloat16, experts_quant="int4a8")
    asym = ckpts.get("tiny-moe-w4a16-asym", "w4a16", "tiny-moe", symmetric=False)
    with pytest.raises(ValueError, match=r"moe_experts_quant: int4a8 takes symmetric .*'model\.layers\.0\.mlp\."
                                         r"experts\.0\.gate_proj' has zero points"):
        moe_block(asym, cpu, torch.bfloat16, experts_quant="int4a8")
    descact = ckpts.get("tiny-moe-gptq-descact", "gptq", "tiny-moe", group_size=16, desc_act=True)
    with pytest.raises(ValueError, match=r"moe_experts_quant: int4a8 takes int4 codes in column order; "
                                         r"'model\.layers\.0\.mlp\.experts\.0\.gate_proj' has an act-order perm"):
        moe_block(descact, cpu, torch.bfloat16, experts_quant="int4a8")
    with pytest.raises(ValueError, match="moe_experts_quant: 'int8' is not one of checkpoint, int4a8"):
        moe_block(moe_a8w8_ckpt, cpu, torch.bfloat16, experts_quant="int8")
    with pytest.raises(ValueError, match="moe_experts_quant: int4a8 applies to Qwen3-MoE checkpoints"):
        make_engine(bf16_ckpt, moe_experts_quant="int4a8")
    from backend_lib.models import Qwen3ForCausalLM   # kernels: auto resolving to another set (a GPU's)

    mc = ModelConfig.from_dir(moe_a8w8_ckpt)
    with pytest.raises(ValueError, match="moe_experts_quant: int4a8 runs on the cpu and reference kernel sets; this "
                                         "engine runs 'triton'"):
        Qwen3ForCausalLM.from_checkpoint(WeightStore(moe_a8w8_ckpt), mc, None, torch.float32, torch.device("cpu"),
                                         get_kernels("cpu", "triton"), 64, moe_experts_quant="int4a8")
    for kw, pattern in (({"kernels": "triton"}, "runs on the cpu and reference kernel sets, not 'triton'"),
                        ({"tensor_parallel_size": 2}, "not supported with tensor_parallel_size > 1"),
                        ({"moe_experts_quant": "int4"}, "'int4' is not one of checkpoint, int4a8")):
        with pytest.raises(ValueError, match=f"moe_experts_quant: .*{pattern}"):
            EngineConfig(checkpoint=str(moe_a8w8_ckpt), **{"moe_experts_quant": "int4a8", **kw}).validate()
