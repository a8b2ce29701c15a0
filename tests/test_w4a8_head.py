"""`lm_head_quant: int4a8`: the int4 head's codes on per-row int8 activations (kernels/reference/w4a8.py has the
arithmetic, csrc/w4a8.cpp the CPU set's kernel): the formula written out element by element, the CPU kernel's bits
equal to the reference's on every path and shape (vector and scalar, tails, bf16 and fp32, zero and outlier rows),
a row's bits the same alone and batched, and an engine with it giving the same greedy ids alone and batched on the
reference and CPU sets."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from backend_lib.kernels import REFERENCE, get_kernels
from helpers import make_engine


def _formula(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The arithmetic of the docstrings, one element at a time in numpy fp32 (no torch kernel involved)."""
    xf = x.float().numpy()
    n, k = codes.shape
    G = scales.shape[1]
    group = k // G
    out = np.zeros((xf.shape[0], n), dtype=np.float32)
    for m in range(xf.shape[0]):
        amax = np.float32(np.abs(xf[m]).max())
        s = np.float32(amax / np.float32(127.0)) if amax > 0 else np.float32(1.0)
        q = np.clip(np.rint(xf[m] / s), -128, 127).astype(np.int64)   # rint: half to even
        for i in range(n):
            acc = np.float32(0.0)
            for g in range(G):
                cols = slice(g * group, (g + 1) * group)
                isum = int((q[cols] * (codes[i, cols].numpy().astype(np.int64) - 8)).sum())
                acc = np.float32(acc + np.float32(np.float32(isum) * np.float32(scales[i, g])))
            out[m, i] = np.float32(acc * s)
    return torch.from_numpy(out).to(x.dtype)


def _weight(n, k, groups, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, groups, generator=g) * 0.05 + 1e-3).bfloat16().float()
    return codes, scales


def _rows(m, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2
    if m > 2:
        x[1] = 0                 # a zero row: scale 1, every output 0
        x[2, 5 % k] = 300.0      # an outlier: the rest of the row quantizes to a few levels
    return x.to(dtype)


def test_the_reference_is_the_formula_written_out():
    codes, scales = _weight(9, 40, 2, 0)
    for dtype in (torch.float32, torch.bfloat16):
        x = _rows(4, 40, dtype, 1)
        got = REFERENCE.w4a8(x, REFERENCE.w4a8_prepared(codes, scales))
        assert got.dtype == dtype
        assert torch.equal(got, _formula(x, codes, scales))
    assert torch.equal(REFERENCE.w4a8(torch.zeros(2, 40), REFERENCE.w4a8_prepared(codes, scales)), torch.zeros(2, 9))


# (N, K, groups): 64-output panels with tails, one and several groups, the head's 128-column groups, K not a multiple
# of 8 (the scalar path), a group not a multiple of 8 (the scalar path too)
SHAPES = [(72, 192, 3), (130, 128, 1), (64, 256, 2), (203, 2048, 16), (33, 60, 1), (70, 120, 10), (257, 1024, 8)]


@pytest.mark.parametrize("n, k, groups", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_kernel_gives_the_references_bits_alone_and_batched(n, k, groups, dtype):
    cpu = get_kernels("cpu")
    if cpu.w4a8_linear is None:
        pytest.skip("no compiled CPU set here")
    codes, scales = _weight(n, k, groups, n + k)
    prepared, ref = cpu.w4a8_prepared(codes, scales), REFERENCE.w4a8_prepared(codes, scales)
    x = _rows(19, k, dtype, k)
    want = REFERENCE.w4a8(x, ref)
    got = cpu.w4a8(x, prepared)
    assert got.dtype == dtype and torch.equal(got, want)
    # every batch size's tiles (AVX-512 VNNI: 16, 8 and 7 .. 1 rows; otherwise 4 .. 1) and the batch-1 tile give
    # each row its bits
    for m in (2, 3, 5, 7, 8, 9, 12, 16):
        assert torch.equal(cpu.w4a8(x[19 - m:], prepared), want[19 - m:])
    for i in range(19):
        assert torch.equal(cpu.w4a8(x[i:i + 1], prepared), want[i:i + 1])
    assert torch.equal(cpu.w4a8(x[:5].reshape(5, 1, k), prepared), want[:5].reshape(5, 1, n))   # any leading shape


def test_the_cpu_kernel_refuses_mismatched_shapes():
    cpu = get_kernels("cpu")
    if cpu.w4a8_linear is None:
        pytest.skip("no compiled CPU set here")
    prepared = cpu.w4a8_prepared(*_weight(64, 128, 1, 0))
    with pytest.raises(RuntimeError, match="features"):
        cpu.w4a8(torch.randn(1, 136), prepared)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu.w4a8(torch.randn(1, 128).half(), prepared)


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["scalar", "avx2"])
def test_narrower_builds_give_the_native_builds_bits(tmp_path, isa):
    """w4a8.cpp built alone without AVX2 (every element on the scalar path), or with AVX2 but no VNNI (the
    vpmaddubsw loop, where an AVX-512 / AVX-VNNI host's build runs vpdpbusd), gives this machine's build's bits."""
    import platform

    from torch.utils import cpp_extension

    from backend_lib.kernels.cpu import build

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 instruction-set variants")
    flags = set(build._cpu_flags().split())
    vnni = (build.cpu_isa() == "native" and "avx512_vnni" in flags) or (
        build.cpu_isa() in ("native", "avx2vnni") and "avx_vnni" in flags)
    if isa == "avx2" and not vnni:
        pytest.skip("the build compared against has no VNNI: it is the AVX2 build")
    cpu = get_kernels("cpu")
    codes, scales = _weight(200, 1024, 8, 3)
    prepared = cpu.w4a8_prepared(codes, scales)
    x = _rows(21, 1024, torch.bfloat16, 4)   # the AVX-512 VNNI build's 16- and 5-row tiles
    want = [cpu.w4a8(x, prepared), cpu.w4a8(x[:1], prepared)]
    lib = f"qwen3_w4a8_{isa}"
    out = tmp_path / lib
    out.mkdir()
    cpp_extension.load(name=lib, sources=[str(build.CSRC / "w4a8.cpp")], build_directory=str(out),
                       extra_cflags=build._cflags(isa) + [f"-DQK_W4A8_LIB={lib}"],
                       extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    op = getattr(torch.ops, lib).w4a8_linear
    assert torch.equal(op(x, *prepared), want[0]) and torch.equal(op(x[:1], *prepared), want[1])


def test_the_head_refuses_codes_that_are_not_the_int4_heads():
    from backend_lib.checkpoint.int4 import Int4Weight
    from backend_lib.layers.linear import W4A8Linear

    codes, scales = _weight(8, 16, 1, 0)
    with pytest.raises(ValueError, match="zero point 8"):
        W4A8Linear(Int4Weight(codes, scales, torch.full_like(scales, 7), 16, None), REFERENCE)
    with pytest.raises(ValueError, match="column order"):
        W4A8Linear(Int4Weight(codes, scales, torch.full_like(scales, 8), 16, torch.arange(16)), REFERENCE)


def test_an_engine_with_the_int4a8_head_gives_the_same_ids_alone_batched_and_on_both_sets(bf16_ckpt):
    """The head is the formula on int4_head_weight's codes and scales (3 x a one-hot row: the dequantized weight
    times 3 up to the fp32 roundings of s_x = 3/127), and the engine's greedy ids and logprobs are the same alone,
    batched, and on the reference and CPU sets."""
    from backend_lib.config import EngineConfig
    from backend_lib.layers.linear import W4A8Linear, int4_head_weight

    assert EngineConfig.from_params({"checkpoint": "x", "lm_head_quant": "int4a8"}).lm_head_quant == "int4a8"
    prompts = [[9707, 11, 1879, 0, 576], [40, 1079, 264], [151644, 872, 198, 9707]]
    runs = []
    for kernels in ("reference", "cpu"):
        eng = make_engine(bf16_ckpt, dtype="bfloat16", lm_head_quant="int4a8", kernels=kernels)
        model = eng.runner.model
        assert isinstance(model.lm_head, W4A8Linear)
        hid = model.lm_head.in_features
        with torch.inference_mode():
            got = model.logits(torch.eye(hid, dtype=torch.bfloat16) * 3)
        w = int4_head_weight(_head(bf16_ckpt))
        eye = torch.eye(hid, dtype=torch.float32) * 3
        assert torch.equal(got, REFERENCE.w4a8(eye, REFERENCE.w4a8_prepared(w.codes, w.scales)))
        dq = (w.codes.float() - 8) * w.scales.repeat_interleave(w.group_size, 1)
        torch.testing.assert_close(got.t(), dq * 3, rtol=1e-6, atol=0)
        params = eng.make_params({"temperature": 0, "max_tokens": 12, "ignore_eos": True})
        alone = [eng.generate([p], params)[0]["output_ids"] for p in prompts]
        batched = [r["output_ids"] for r in eng.generate(prompts, params)]
        assert batched == alone
        runs.append((batched, [eng.score(p + ids) for p, ids in zip(prompts, batched)]))   # every position's logprob
    assert runs[0] == runs[1]


def _head(folder) -> torch.Tensor:
    from safetensors import safe_open

    f = safe_open(str(folder / "model.safetensors"), "pt")
    name = "lm_head.weight" if "lm_head.weight" in f.keys() else "model.embed_tokens.weight"
    return f.get_tensor(name).to(torch.bfloat16)
