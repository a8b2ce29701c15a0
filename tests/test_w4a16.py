"""Int4 weight-only checkpoints (compressed-tensors pack-quantized, GPTQ, AWQ): layouts against their peers'
unpacking, the model against transformers on the same dequantized weights, the kernel rows bit for bit."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from backend_lib.checkpoint import CheckpointError, WeightStore, parse_quantization_config
from backend_lib.checkpoint.int4 import read_int4
from backend_lib.kernels import REFERENCE, get_kernels
from helpers import make_engine

TEXT = "The quick brown fox jumps over the lazy dog. 敏捷的棕色狐狸跳过了懒狗。 " * 2
WIDE = dict(hidden_size=128, intermediate_size=384)        # every K a multiple of 128, for group size 128

# name -> (format, build options)
CHECKPOINTS = {
    "ct-g32-sym": ("w4a16", dict(group_size=32)),
    "ct-g64-asym": ("w4a16", dict(group_size=64, symmetric=False)),
    "ct-g128-sym": ("w4a16", dict(group_size=128, **WIDE)),
    "ct-channel-asym": ("w4a16", dict(group_size=None, symmetric=False)),
    "gptq-g32-sym": ("gptq", dict(group_size=32)),
    "gptq-g64-asym-descact": ("gptq", dict(group_size=64, symmetric=False, desc_act=True)),
    "gptq-g32-descact-own-perms": ("gptq", dict(group_size=32, desc_act=True, shared_perm=False)),
    "gptq-channel-sym": ("gptq", dict(group_size=None)),
    "awq-g64": ("awq", dict(group_size=64)),
    "awq-g128": ("awq", dict(group_size=128, **WIDE)),
}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def int4_ckpt(ckpts):
    def get(name):
        fmt, opts = CHECKPOINTS[name]
        return ckpts.get(f"tiny-{name}", fmt, **opts)
    return get


def _linear_shapes(cfg: dict):
    h, kvh, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    hid, inter = cfg["hidden_size"], cfg["intermediate_size"]
    return {"self_attn.q_proj": (h * d, hid), "self_attn.k_proj": (kvh * d, hid), "self_attn.v_proj": (kvh * d, hid),
            "self_attn.o_proj": (hid, h * d), "mlp.gate_proj": (inter, hid), "mlp.up_proj": (inter, hid),
            "mlp.down_proj": (hid, inter)}


def _ours(folder):
    """Our dequantized fp32 weights of every quantized Linear (checkpoint column order)."""
    cfg = json.loads((folder / "config.json").read_text())
    scheme = parse_quantization_config(cfg["quantization_config"])
    store = WeightStore(folder)
    out = {}
    for i in range(cfg["num_hidden_layers"]):
        for leaf, (n, k) in _linear_shapes(cfg).items():
            name = f"model.layers.{i}.{leaf}"
            out[name] = read_int4(store, name, n, k, scheme.int4).dequantize()
    return out


# ----- layouts against their peers --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["ct-g32-sym", "ct-g64-asym", "ct-channel-asym"])
def test_pack_quantized_dequantizes_as_compressed_tensors(int4_ckpt, name):
    """Peer: compressed-tensors' own decompression (the checkpoint was also written by compressed-tensors), with
    the scales in fp32 so that its products are exact as ours; and transformers' loading of it, which rounds them
    to the model dtype."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    folder = int4_ckpt(name)
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized"
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**qc["config_groups"]["group_0"]["weights"]))
    f = safe_open(str(folder / "model.safetensors"), "pt")
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                              quantization_config=CompressedTensorsConfig(run_compressed=False))
    for mod_name, ours in _ours(folder).items():
        state = {k: f.get_tensor(f"{mod_name}.{k}") for k in ("weight_packed", "weight_scale", "weight_shape",
                                                               "weight_zero_point") if f"{mod_name}.{k}" in f.keys()}
        state["weight_scale"] = state["weight_scale"].float()
        peer = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
        assert torch.equal(ours, peer), mod_name
        assert torch.equal(ours.to(torch.bfloat16).float(), hf.get_submodule(mod_name).weight.data), mod_name


def _awq_peer(qweight, qzeros, scales):
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    q, s, z = AutoAWQConverter(group_size=qweight.shape[0] // scales.shape[0])._convert_gemm_module(qweight, scales, qzeros)
    group = q.shape[1] // s.shape[1]
    return (q.float() - z.float().repeat_interleave(group, 1)) * s.float().repeat_interleave(group, 1)


@pytest.mark.parametrize("name", ["awq-g64", "awq-g128"])
def test_awq_dequantizes_as_the_compressed_tensors_awq_converter(int4_ckpt, name):
    """Peer: compressed-tensors' AutoAWQ GEMM converter (unpacking, AWQ's interleaved order, zero points)."""
    folder = int4_ckpt(name)
    f = safe_open(str(folder / "model.safetensors"), "pt")
    for mod_name, ours in _ours(folder).items():
        peer = _awq_peer(f.get_tensor(f"{mod_name}.qweight"), f.get_tensor(f"{mod_name}.qzeros"),
                         f.get_tensor(f"{mod_name}.scales"))
        assert torch.equal(ours, peer), mod_name


@pytest.mark.parametrize("name", ["gptq-g32-sym", "gptq-g64-asym-descact", "gptq-channel-sym"])
def test_gptq_dequantizes_by_the_documented_formula(int4_ckpt, name):
    """No GPTQ peer installs here (gptqmodel ships an sdist of native extensions; optimum needs it): the formula
    of the format, element by element: W[n, k] = (q(k, n) - (z(g, n) + 1)) * scales[g, n], g = g_idx[k]."""
    folder = int4_ckpt(name)
    f = safe_open(str(folder / "model.safetensors"), "pt")
    for mod_name, ours in _ours(folder).items():
        qweight, qzeros = f.get_tensor(f"{mod_name}.qweight"), f.get_tensor(f"{mod_name}.qzeros")
        scales, g_idx = f.get_tensor(f"{mod_name}.scales").float(), f.get_tensor(f"{mod_name}.g_idx").long()
        k = torch.arange(qweight.shape[0] * 8)[:, None]
        n = torch.arange(qweight.shape[1])[None, :]
        q = (qweight[k // 8, n] >> (4 * (k % 8))) & 15
        z = ((qzeros[g_idx[:, None], n // 8] >> (4 * (n % 8))) & 15) + 1
        expected = ((q - z).float() * scales[g_idx[:, None], n]).t()
        assert torch.equal(ours, expected), mod_name
    if "descact" in name:
        assert not torch.equal(g_idx, torch.arange(g_idx.numel()) // 64), "act order should permute the groups"


# ----- the model against transformers on the same dequantized weights ---------------------------------------

def _hf_on_dequantized(folder, ckpts, name):
    """transformers' Qwen3 in fp32 holding our dequantized weights, which the tests above check against the
    peers (transformers' own loading of a pack-quantized checkpoint rounds them to the model dtype). The
    float checkpoint of the same seed gives the unquantized tensors (embeddings, norms), which are the same."""
    from transformers import AutoModelForCausalLM

    wide = "hidden_size" in CHECKPOINTS[name][1]
    base = ckpts.get("tiny-bf16-wide", "bf16", **WIDE) if wide else ckpts.get("tiny-bf16", "bf16")
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    for mod_name, w in _ours(folder).items():
        model.get_submodule(mod_name).weight.data = w
    return model


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_greedy_and_logprobs_equal_transformers_on_the_dequantized_weights(int4_ckpt, ckpts, name):
    folder = int4_ckpt(name)
    hf = _hf_on_dequantized(folder, ckpts, name).eval()
    eng = make_engine(folder)
    assert eng.quantization == "w4a16"
    ids = eng.tokenizer.encode(TEXT)
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(eng.score(ids)[1:]), ref, rtol=0, atol=1e-4)
    res = eng.generate([ids], eng.make_params({"temperature": 0, "max_tokens": 16, "ignore_eos": True}))[0]
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    expected = out[0, len(ids):].tolist()
    assert res["output_ids"] == expected and len(set(expected)) > 4


def test_int4_weights_are_not_the_float_weights(int4_ckpt, bf16_engine):
    """The comparison above can fail: int4 weights change the logprobs far beyond its tolerance."""
    eng = make_engine(int4_ckpt("ct-g32-sym"))
    ids = eng.tokenizer.encode(TEXT)
    assert (torch.tensor(eng.score(ids)[1:]) - torch.tensor(bf16_engine.score(ids)[1:])).abs().mean() > 1e-2


@pytest.mark.parametrize("name", ["ct-g64-asym", "gptq-g64-asym-descact", "gptq-g32-descact-own-perms"])
def test_reference_kernels_give_the_same_tokens(int4_ckpt, name):
    folder = int4_ckpt(name)
    cpu, ref = make_engine(folder), make_engine(folder, kernels="reference")
    ids = cpu.tokenizer.encode(TEXT)
    params = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    assert cpu.generate([ids], cpu.make_params(params))[0]["output_ids"] == \
        ref.generate([ids], ref.make_params(params))[0]["output_ids"]
    torch.testing.assert_close(torch.tensor(cpu.score(ids)[1:]), torch.tensor(ref.score(ids)[1:]), rtol=0, atol=1e-4)


def test_projections_with_their_own_act_order_are_not_fused(int4_ckpt):
    from backend_lib.layers.linear import ConcatLinear, W4A16Linear

    shared = make_engine(int4_ckpt("gptq-g64-asym-descact")).runner.model.layers[0]
    own = make_engine(int4_ckpt("gptq-g32-descact-own-perms")).runner.model.layers[0]
    assert isinstance(shared.self_attn.qkv_proj, W4A16Linear) and isinstance(shared.mlp.gate_up_proj, W4A16Linear)
    assert isinstance(own.self_attn.qkv_proj, ConcatLinear) and isinstance(own.mlp.gate_up_proj, ConcatLinear)


def test_batched_generation_equals_solo(int4_ckpt):
    eng = make_engine(int4_ckpt("gptq-g64-asym-descact"), dtype="bfloat16")
    prompts = [eng.tokenizer.encode(p) for p in ("Hello!", TEXT, "1, 2, 3, 4,", "介绍一下北京故宫")]
    params = eng.make_params({"temperature": 0, "max_tokens": 12, "ignore_eos": True})
    solo = [eng.generate([p], params)[0]["output_ids"] for p in prompts]
    assert [r["output_ids"] for r in eng.generate(prompts, params)] == solo


# ----- the kernels ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("group", [32, 64, 128, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("permuted", [False, True])
@pytest.mark.parametrize("symmetric", [False, True])
def test_kernel_rows_are_bit_identical_alone_or_batched(group, dtype, permuted, symmetric):
    """symmetric: one zero point and bf16 scales, as symmetric checkpoints store them, where the CPU kernel's
    batch-1 rows take its table lookup (with bf16 rows; fp32 rows keep the multiply) and the batched rows do not:
    the same bits."""
    torch.manual_seed(0)
    n, k = 136, 256                     # 3 panels of 64 outputs, the last partial
    g = k // (group or k)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales, zeros = torch.rand(n, g) * 0.05 + 1e-3, torch.randint(0, 17, (n, g)).float()
    if symmetric:
        scales, zeros = scales.bfloat16().float(), torch.full((n, g), 8.0)
    perm = torch.randperm(k) if permuted else None
    x = torch.randn(21, k).to(dtype)
    for kernels in (get_kernels("cpu"), REFERENCE):
        prepared = kernels.w4a16_prepare(codes, scales, zeros, perm)
        full = kernels.w4a16_linear(x, prepared)
        assert full.dtype == dtype and full.shape == (21, n)
        for lo, hi in ((0, 1), (5, 6), (0, 4), (3, 10), (7, 21), (20, 21)):
            assert torch.equal(kernels.w4a16_linear(x[lo:hi], prepared), full[lo:hi]), (kernels.name, lo, hi)
    w = (codes.float() - zeros.repeat_interleave(k // g, 1)) * scales.repeat_interleave(k // g, 1)
    xs = x.float() if perm is None else x.float()[:, perm]
    expected = xs.double() @ w.double().t()
    cpu = get_kernels("cpu").w4a16_linear(x, get_kernels("cpu").w4a16_prepare(codes, scales, zeros, perm))
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(cpu.double(), expected.to(dtype).double(), rtol=tol, atol=tol * expected.abs().max().item())


def test_cpu_table_lookup_is_taken_only_where_exact():
    """The batch-1 table lookup (csrc/w4a16.cpp tile_lut) needs one zero point and scales of at most 20
    significant bits; fp32 scales, or zero points that differ, keep the multiply."""
    from backend_lib.kernels.cpu import _lut_zero

    scales = torch.rand(64, 4) * 0.05 + 1e-3
    assert _lut_zero(scales.bfloat16().float(), torch.full((64, 4), 8.0)) == 8.0
    assert _lut_zero(scales.half().float(), torch.full((64, 4), 7.0)) == 7.0
    assert _lut_zero(scales, torch.full((64, 4), 8.0)) == -1.0
    assert _lut_zero(scales.bfloat16().float(), torch.randint(0, 17, (64, 4)).float()) == -1.0
    assert _lut_zero(torch.full((64, 4), 2.0 ** -120), torch.full((64, 4), 8.0)) == -1.0
    with pytest.raises(ValueError, match="zero points must be integers"):   # the kernel subtracts 2^23 + zero
        get_kernels("cpu").w4a16_prepare(torch.zeros(64, 128, dtype=torch.uint8), scales, torch.full((64, 4), 7.5))


def _fp32_fma(a: float, b: float, c: float) -> float:
    """fma in fp32 exactly: a * b + c as a rational, rounded once to the nearest fp32 (ties to even)."""
    import numpy as np
    from fractions import Fraction

    exact = Fraction(a) * Fraction(b) + Fraction(c)
    if exact == 0:
        return 0.0
    f = np.float32(float(exact))
    cands = (np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf)))
    return float(min(cands, key=lambda v: (abs(Fraction(float(v)) - exact), int(np.array(v).view(np.int32)) & 1)))


@pytest.mark.parametrize("symmetric", [False, True])
def test_cpu_kernel_batch1_equals_the_fma_chain(symmetric):
    """One row against the contract's arithmetic written out: acc = fma(x[k], (q - zero) * scale, acc) in fp32 for
    k in order, bit for bit; a bf16 row (the symmetric weight's table lookup) and an fp32 row with low mantissa
    bits set (which the lookup refuses: the multiply)."""
    torch.manual_seed(3)
    n, k, g = 8, 64, 2
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales = (torch.rand(n, g) * 0.05 + 1e-3).bfloat16().float()
    zeros = torch.full((n, g), 8.0) if symmetric else torch.randint(0, 17, (n, g)).float()
    w = (codes.float() - zeros.repeat_interleave(k // g, 1)) * scales.repeat_interleave(k // g, 1)
    cpu = get_kernels("cpu")
    prepared = cpu.w4a16_prepare(codes, scales, zeros, None)
    for x in (torch.randn(1, k).bfloat16().float(), torch.randn(1, k)):
        want = []
        for i in range(n):
            acc = 0.0
            for j in range(k):
                acc = _fp32_fma(x[0, j].item(), w[i, j].item(), acc)
            want.append(acc)
        assert torch.equal(cpu.w4a16_linear(x, prepared)[0], torch.tensor(want, dtype=torch.float32))


def test_cpu_kernel_dequantizes_exactly_as_written():
    """With x = a unit vector the product is one dequantized weight: (q - zero) * scale, bit for bit."""
    torch.manual_seed(1)
    n, k = 64, 128
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales, zeros = torch.rand(n, 4) * 0.1, torch.randint(0, 17, (n, 4)).float()
    kernels = get_kernels("cpu")
    assert kernels.name == "cpu"
    eye = torch.eye(k)
    y = kernels.w4a16_linear(eye, kernels.w4a16_prepare(codes, scales, zeros, None))
    assert torch.equal(y.t(), REFERENCE.w4a16_prepare(codes, scales, zeros)[0])


def _int4_head_rule(w: torch.Tensor, group: int) -> torch.Tensor:
    """lm_head_quant int4 written out: per group, s = bf16(max|w| / 7.5), q = clamp(round(w / s), -8, 7), w' = q * s."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    s = (g.abs().amax(-1, keepdim=True) / 7.5).clamp_min(1e-6).to(torch.bfloat16).float()
    return (torch.clamp(torch.round(g / s), -8, 7) * s).reshape(n, k)


@pytest.mark.parametrize("name", ["ct-g128-sym", None])
def test_int4_lm_head_is_the_w4a16_kernel_on_a_group_quantized_head(int4_ckpt, bf16_ckpt, name):
    """lm_head_quant int4: the head is quantized at load per group of 128 columns (per row where the hidden size
    is not a multiple of 128) by compressed-tensors' symmetric rule with bf16 scales, and computed by the W4A16
    kernel: a one-hot hidden row reads back exactly the rule's dequantized weight, in fp32; the tied embedding
    keeps the checkpoint's rows; greedy ids do not depend on the batch."""
    from backend_lib.config import EngineConfig
    from backend_lib.layers.linear import W4A16Linear

    folder = int4_ckpt(name) if name else bf16_ckpt
    eng = make_engine(folder, dtype="bfloat16", lm_head_quant="int4")
    model = eng.runner.model
    assert isinstance(model.lm_head, W4A16Linear)
    f = safe_open(str(folder / "model.safetensors"), "pt")
    head_name = "lm_head.weight" if "lm_head.weight" in f.keys() else "model.embed_tokens.weight"
    w = f.get_tensor(head_name).to(torch.bfloat16)
    hid = w.shape[1]
    want = _int4_head_rule(w, 128 if hid % 128 == 0 else hid)
    ids = torch.tensor([0, 7, 9707, w.shape[0] - 1])
    assert torch.equal(model.embed(ids), f.get_tensor("model.embed_tokens.weight")[ids].to(torch.bfloat16))
    with torch.inference_mode():
        got = model.logits(torch.eye(hid, dtype=torch.bfloat16))
    assert got.dtype == torch.float32
    assert torch.equal(got.t(), want)
    prompts = [[9707, 11, 1879, 0, 576], [40, 1079, 264], [151644, 872, 198, 9707]]
    params = eng.make_params({"temperature": 0, "max_tokens": 12, "ignore_eos": True})
    alone = [eng.generate([p], params)[0]["output_ids"] for p in prompts]
    assert [r["output_ids"] for r in eng.generate(prompts, params)] == alone
    assert EngineConfig.from_params({"checkpoint": "x", "lm_head_quant": "int4"}).lm_head_quant == "int4"


def test_int4_head_groups_are_128_columns_and_rows_chunk_alike():
    """A head 256 wide quantizes in two groups a row (the checkpoints above are at most 128 wide), the same
    whatever the chunk of rows quantized at once."""
    from backend_lib.layers.linear import int4_head_weight

    torch.manual_seed(3)
    w = (torch.randn(300, 256) * torch.linspace(0.01, 3, 256)).to(torch.bfloat16)
    got = int4_head_weight(w)
    assert got.group_size == 128 and tuple(got.scales.shape) == (300, 2)
    assert torch.equal(got.dequantize(), _int4_head_rule(w, 128))
    assert torch.equal(int4_head_weight(w, rows_per_chunk=7).dequantize(), got.dequantize())


# ----- configs refused naming the field ---------------------------------------------------------------------

def _copy_with(folder, tmp_path, fn):
    dst = tmp_path / "ck"
    shutil.copytree(folder, dst)
    cfg = json.loads((dst / "config.json").read_text())
    fn(cfg["quantization_config"])
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("name, mutate, message", [
    ("gptq-g32-sym", lambda q: q.update(bits=8), "quantization_config.bits: 8 is not supported"),
    ("gptq-g32-sym", lambda q: q.update(bits=3), "quantization_config.bits: 3"),
    ("gptq-g32-sym", lambda q: q.update(checkpoint_format="marlin"), "quantization_config.checkpoint_format: 'marlin'"),
    ("gptq-g32-sym", lambda q: q.update(lm_head=True), "quantization_config.lm_head"),
    ("gptq-g32-sym", lambda q: q.update(group_size=0), "quantization_config.group_size: 0"),
    ("gptq-g32-sym", lambda q: q.update(exotic_option=1), "quantization_config.exotic_option"),
    ("gptq-g32-sym", lambda q: q.update(group_size=64), "tensor 'model.layers.0.self_attn.q_proj.scales' has shape"),
    ("awq-g64", lambda q: q.update(version="gemv"), "quantization_config.version: 'gemv'"),
    ("awq-g64", lambda q: q.update(zero_point=False), "quantization_config.zero_point"),
    ("awq-g64", lambda q: q.update(bits=8), "quantization_config.bits: 8"),
    ("ct-g32-sym", lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=8), "weights.num_bits: 8"),
    ("ct-g32-sym", lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="tensor"),
     "weights.strategy: 'tensor'"),
    ("ct-g32-sym", lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=12), "weights.group_size: 12"),
    ("ct-g32-sym", lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="dynamic"),
     "weights.actorder: 'dynamic'"),
    ("ct-g32-sym", lambda q: q["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}),
     "group_0.input_activations"),
    ("ct-g32-sym", lambda q: q["config_groups"]["group_0"].update(format="marlin-24"), "group_0.format: 'marlin-24'"),
])
def test_bad_int4_configs_are_refused_naming_the_field(int4_ckpt, tmp_path, name, mutate, message):
    dst = _copy_with(int4_ckpt(name), tmp_path, mutate)
    with pytest.raises(CheckpointError) as err:
        make_engine(dst)
    assert message in str(err.value)


@pytest.mark.slow
def test_isa_paths_give_the_same_bits(tmp_path):
    """w4a16.cpp built alone without AVX2 (the scalar path) gives the bits of this machine's widest build: every
    path computes the same fma chain, so every bit agrees. (The AVX2 builds' W4A16 bits are checked against the
    native build's in tests/test_cpu_isa.py, whose child processes load those whole kernel sets anyway: building
    w4a16.cpp for AVX2 here again cost ~10 s of compiling.)"""
    import platform

    from torch.utils import cpp_extension

    from backend_lib.kernels.cpu import build

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 instruction-set variants")
    cpu = get_kernels("cpu")
    torch.manual_seed(2)
    n, k = 72, 192
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales, zeros = torch.rand(n, 3) * 0.05, torch.randint(0, 17, (n, 3)).float()
    perm = torch.randperm(k)
    prepared = cpu.w4a16_prepare(codes, scales, zeros, perm)
    sym = cpu.w4a16_prepare(codes, scales.bfloat16().float(), torch.full_like(zeros, 8.0), perm)   # table lookup
    x = torch.randn(9, k).to(torch.bfloat16)
    want = cpu.w4a16_linear(x, prepared)
    want_sym = [cpu.w4a16_linear(x[i:i + 1], sym) for i in range(3)]
    lib = "qwen3_w4a16_scalar"
    out = tmp_path / lib
    out.mkdir()
    # memory.cpp: the packing's huge-page buffers (stream_zeros)
    sources = [str(build.CSRC / "w4a16.cpp"), str(build.CSRC / "memory.cpp")]
    cpp_extension.load(name=lib, sources=sources, build_directory=str(out),
                       extra_cflags=build._cflags("scalar") + [f"-DQK_W4A16_LIB={lib}"],   # build.ISA_FLAGS
                       extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    assert torch.equal(getattr(torch.ops, lib).w4a16_linear(x, *prepared), want)
    assert all(torch.equal(getattr(torch.ops, lib).w4a16_linear(x[i:i + 1], *sym), want_sym[i]) for i in range(3))


def test_unpacked_int8_zero_points_of_older_compressed_tensors_load_the_same(int4_ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    src = int4_ckpt("ct-g64-asym")
    dst = tmp_path / "old-zp"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".weight_zero_point")]:
        packed = tensors[name]                                           # int32 [N/8, G], packed along N
        codes = ((packed.t()[..., None] >> torch.arange(0, 32, 4, dtype=torch.int32)) & 15).reshape(packed.shape[1], -1)
        tensors[name] = (codes.t() - 8).to(torch.int8).contiguous()      # signed, [N, G]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    ours, old = _ours(src), _ours(dst)
    assert all(torch.equal(ours[n], old[n]) for n in ours)
