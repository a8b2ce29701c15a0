"""Ahead-of-time compilation of every Triton kernel variant the engine launches, for sm_90 and sm_80, on this
CPU-only machine: no register spills, shared memory within the limit, int8 MMA in the A8W8 GEMM, no MMA (full
fp32) in the W4A16 GEMMs (dense and fused MoE, with and without the act-order perm)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="the triton package is not installed (pip install -e '.[test]')")

from helpers import ROOT  # noqa: E402

LAUNCHED = {"a8w8_kernel", "float_linear_kernel", "rms_norm_kernel", "qk_norm_rope_kernel", "silu_mul_kernel",
            "write_kv_kernel", "attention_kernel", "combine_kernel", "rotate_kernel", "tq_write_kernel",
            "moe_gemm_kernel", "moe_combine_kernel", "w4a16_kernel"}


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}    # the GPU code path, not numpy
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "backend_lib.kernels.triton.aot", "--json"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.stdout, proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_launched_kernel_compiles_for_sm90_and_sm80_without_spills_or_excess_shared_memory(compiled):
    rc, out = compiled
    assert out["problems"] == [] and rc == 0, out["problems"]
    results = out["results"]
    for arch in (90, 80):
        assert {r["kernel"] for r in results if r["arch"] == arch} == LAUNCHED
    assert all(r["registers"] <= 255 and r["spill_stores"] == 0 and r["shared"] <= r["shared_limit"]
               for r in results)
    labels = {r["label"] for r in results}
    assert {"attention bf16 group=2", "attention tq group=4", "a8w8 M=1 even_k=True", "a8w8 M=65 even_k=True",
            "attention bf16 group=4 split programs", "attention tq group=4 split programs"} <= labels
    assert {"moe a8w8 gate_up+swiglu BLOCK_M=16", "moe a8w8 down+weight BLOCK_M=16", "moe a8w8 gate_up+swiglu BLOCK_M=64",
            "moe a8w8 down+weight BLOCK_M=64", "moe bf16 gate_up+swiglu BLOCK_M=16", "moe bf16 down+weight BLOCK_M=16",
            "moe combine hidden=2048", "moe combine hidden=4096"} <= labels
    assert {f"w4a16 tile_group={t} perm={p}" for t in (True, False) for p in (True, False)} <= labels
    assert {f"moe w4a16 {g} tile_group={t}" for g in ("gate_up+swiglu", "down+weight") for t in (True, False)} <= labels
    # GPTQ act-order experts (rows gathered through each expert's perm): gate/up sharing one or each its own, down
    assert {f"moe w4a16 gate_up+swiglu tile_group={t} perm={p}" for t in (True, False) for p in ("shared", "own")} | \
        {f"moe w4a16 down+weight tile_group={t} perm=own" for t in (True, False)} <= labels


def test_the_int8_gemm_uses_int8_mma_and_wgmma_on_hopper(compiled):
    results = compiled[1]["results"]
    gemm = [r for r in results if r["kernel"] == "a8w8_kernel"]
    assert gemm and all(any(".s8.s8" in i for i in r["mma"]) for r in gemm)
    moe = [r for r in results if r["kernel"] == "moe_gemm_kernel"]      # the fused MoE's grouped GEMMs
    assert all(any(".s8.s8" in i for i in r["mma"]) for r in moe if "a8w8" in r["label"])
    assert all(any("bf16" in i for i in r["mma"]) for r in moe if "bf16" in r["label"])
    assert any(i.startswith("wgmma") for r in gemm if r["arch"] == 90 for i in r["mma"])   # the prefill tiles
    assert not any(i.startswith("wgmma") for r in gemm if r["arch"] == 80 for i in r["mma"])
    assert all(any("bf16" in i for i in r["mma"]) for r in results if r["kernel"] == "float_linear_kernel")
    # the int4 GEMM's dot is full fp32 (the contract's fp32 dequantized weight): FMA, no bf16 / TF32 MMA that would
    # round the weight or x
    assert all(r["mma"] == [] for r in results if r["kernel"] == "w4a16_kernel" or "w4a16" in r["label"])


def test_the_checks_catch_spills_shared_memory_and_a_gemm_without_mma():
    from backend_lib.kernels.triton.aot import problems

    ok = {"kernel": "a8w8_kernel", "label": "a8w8", "arch": 90, "spill_stores": 0, "spill_loads": 0,
          "shared": 1024, "shared_limit": 232448, "mma": ["mma.sync.aligned.m16n8k32.row.col.satfinite.s32.s8.s8.s32"]}
    assert problems([ok]) == []
    assert len(problems([{**ok, "spill_stores": 4}])) == 1
    assert len(problems([{**ok, "shared": 300_000}])) == 1
    assert len(problems([{**ok, "mma": ["mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"]}])) == 1
    moe = {**ok, "kernel": "moe_gemm_kernel", "label": "moe a8w8 gate_up+swiglu BLOCK_M=16"}
    assert problems([moe]) == [] and len(problems([{**moe, "mma": []}])) == 1
    assert problems([{**moe, "label": "moe bf16 down+weight BLOCK_M=16", "mma": []}]) == []
