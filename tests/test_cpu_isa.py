"""$QWEN3_CPU_ISA (backend_lib/kernels/cpu/build.py): the CPU kernel set built for fewer instructions than the host
has, so that the AVX2 paths (AVX2 + FMA; AVX2 + AVX-VNNI) are built, run and tested on an AVX-512 host too.

Each build runs in a child process (one kernel library per process): it must load the set of its ISA (its A8W8
packing layout and whether it reads the column sums say which path it compiled), give the reference's A8W8 bits
(exact int32 sums on every path: odd K, N off the panel, every row-tile size, the int8 extremes) and the native
build's W4A16 bits, and run a tiny A8W8 demo whose greedy ids are the same alone and batched, with the C++ layer
loop and with the Python one. (The builds' float sums run over 8 lanes instead of 16, so their hidden states are
not the AVX-512 build's: what must hold is that each build is exact where the kernels are integer and batch
invariant everywhere.) The demo is the session's tiny A8W8 checkpoint, passed to the child (building its own cost
each child ~7 s of imports and writing). On a host that lacks what a build takes away, that build is the native
one's code, so the child loads the native build instead.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from backend_lib.kernels.cpu import build

ROOT = Path(__file__).resolve().parent.parent

CHILD = r'''
import json, sys
from pathlib import Path
import torch
sys.path.insert(0, "tests")
from helpers import make_engine
from backend_lib.kernels import get_kernels, reference as ref

ckpt, w4_path = Path(sys.argv[1]), sys.argv[2]
cpu = get_kernels("cpu", "cpu")
out = {"layout": list(torch.ops.qwen3_cpu.a8w8_pack(torch.zeros(16, 8, dtype=torch.int8)).shape[2:])}
# which path was built: the VNNI paths offset the activations by +128 and subtract 128 * colsum, so a wrong colsum
# changes their output; the AVX2 path's signed activations never read it
_w = torch.randint(-128, 128, (16, 8), dtype=torch.int8)
_p = cpu.a8w8_prepare(_w, torch.ones(16))
_x = torch.randn(2, 8)
out["reads_colsum"] = not torch.equal(cpu.a8w8_linear(_x, _p), cpu.a8w8_linear(_x, (_p[0], _p[1], torch.zeros_like(_p[2]))))
bad = []
for K, N in ((1, 9), (7, 37), (9, 16), (1001, 37), (1024, 96)):
    g = torch.Generator().manual_seed(K + N)
    x = torch.randn(30, K, generator=g) * 5
    x[3] = -x[3].abs()
    w_q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    w_q[0] = -128
    w_s = torch.rand(N, generator=g) * 0.01
    p = cpu.a8w8_prepare(w_q, w_s)
    for dt in (torch.float32, torch.bfloat16):
        xd = x.to(dt)
        full = cpu.a8w8_linear(xd, p)
        if not torch.equal(full, ref.a8w8_linear(xd, w_q, w_s)):
            bad.append(f"K={K} N={N} {dt}: 30 rows")
        for m in range(1, 14):
            if not torch.equal(cpu.a8w8_linear(xd[:m], p), full[:m]):
                bad.append(f"K={K} N={N} {dt}: {m} rows")
out["a8w8_mismatches"] = bad
# W4A16: every path computes the same fma chain, so its bits are the native build's (asymmetric and the
# symmetric table lookup, batched and one row)
w4 = torch.load(w4_path)
prep = cpu.w4a16_prepare(w4["codes"], w4["scales"], w4["zeros"], w4["perm"])
sym = cpu.w4a16_prepare(w4["codes"], w4["scales"].bfloat16().float(), torch.full_like(w4["zeros"], 8.0), w4["perm"])
out["w4a16_equal"] = [torch.equal(cpu.w4a16_linear(w4["x"], prep), w4["want"])] + [
    torch.equal(cpu.w4a16_linear(w4["x"][i:i + 1], sym), w4["want_sym"][i]) for i in range(3)]
# the MoE routing (csrc/route.cpp): its at::vec softmax built for AVX2, run where ATen runs AVX2 (the parent sets
# ATEN_CPU_CAPABILITY=avx2), against layers/moe.py's route()
from backend_lib.layers.moe import route
g = torch.Generator().manual_seed(5)
rx = torch.randn(400, 128, generator=g) * torch.tensor([0.01, 1.0, 4.0, 40.0]).repeat(100)[:, None]
out["route_path"] = torch.ops.qwen3_cpu.moe_route_path(8, True)
out["route_equal"] = all(torch.equal(a, b) for dt in (torch.float32, torch.bfloat16) for k in (2, 8)
                         for a, b in zip(torch.ops.qwen3_cpu.moe_route(rx.to(dt), k, True), route(rx.to(dt), k, True)))
eng = make_engine(ckpt, dtype="bfloat16", kernels="cpu", max_num_seqs=4, kv_cache_memory="4MiB", max_model_len=256)
prompts = [eng.tokenizer.encode("the quick brown fox " * (1 + 3 * i))[: 5 + 17 * i] for i in range(3)]
params = eng.make_params({"temperature": 0, "max_tokens": 12, "ignore_eos": True})
ids = lambda: [r["output_ids"] for r in eng.generate(prompts, params)]
out["batched"] = ids()
out["again"] = ids()
out["alone"] = [eng.generate([p], params)[0]["output_ids"] for p in prompts]
eng.runner.model.use_layer_loop = False
out["python_loop"] = ids()
print("RESULT " + json.dumps(out))
'''


# The /proc/cpuinfo flag of each instruction set an ISA build removes (build.ISA_FLAGS).
MNO_FLAG = {"-mno-avx512f": "avx512f", "-mno-avxvnni": "avx_vnni", "-mno-avx2": "avx2", "-mno-fma": "fma"}


def _host_flags() -> set[str]:
    return set(build._cpu_flags().split())


def test_an_unknown_isa_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("QWEN3_CPU_ISA", "avx9000")
    with pytest.raises(ValueError, match="QWEN3_CPU_ISA='avx9000'"):
        build.cpu_isa()
    for isa in build.ISA_FLAGS:
        monkeypatch.setenv("QWEN3_CPU_ISA", isa.upper())
        assert build.cpu_isa() == isa
    monkeypatch.delenv("QWEN3_CPU_ISA")
    assert build.cpu_isa() == "native"


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the ISA builds are x86-64 ones")
def test_each_isa_has_its_own_flags_and_build_key(monkeypatch):
    sources = sorted(p for p in build.CSRC.iterdir() if p.suffix == ".cpp")
    keys = set()
    for isa, extra in build.ISA_FLAGS.items():
        monkeypatch.setenv("QWEN3_CPU_ISA", isa)
        flags = build._cflags()
        assert flags == build._cflags(isa) and "-march=native" in flags and set(extra) <= set(flags)
        keys.add(build._build_key(sources, flags))
    assert len(keys) == len(build.ISA_FLAGS)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the ISA builds are x86-64 ones")
@pytest.mark.parametrize("isa, reads_colsum, needs", [("avx2", False, {"avx2", "fma"}),
                                                      ("avx2vnni", True, {"avx2", "fma", "avx_vnni"})])
def test_the_avx2_builds_load_are_exact_and_batch_invariant(isa, reads_colsum, needs, a8w8_ckpt, tmp_path):
    if not needs <= _host_flags():
        pytest.skip(f"this host lacks {sorted(needs - _host_flags())}")
    import torch

    from backend_lib.kernels import get_kernels

    cpu = get_kernels("cpu", "cpu")          # this process's native build: the W4A16 bits the child must give
    g = torch.Generator().manual_seed(2)
    n, k = 72, 192
    w4 = dict(codes=torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
              scales=torch.rand(n, 3, generator=g) * 0.05, zeros=torch.randint(0, 17, (n, 3), generator=g).float(), perm=torch.randperm(k, generator=g),
              x=torch.randn(9, k, generator=g).to(torch.bfloat16))
    prep = cpu.w4a16_prepare(w4["codes"], w4["scales"], w4["zeros"], w4["perm"])
    sym = cpu.w4a16_prepare(w4["codes"], w4["scales"].bfloat16().float(), torch.full_like(w4["zeros"], 8.0), w4["perm"])
    w4["want"] = cpu.w4a16_linear(w4["x"], prep)
    w4["want_sym"] = [cpu.w4a16_linear(w4["x"][i:i + 1], sym) for i in range(3)]
    torch.save(w4, tmp_path / "w4a16.pt")
    # On a host without the instructions the build takes away (an AVX2-only one), the ISA's build is the native
    # build's code under another cache key: the child then loads the native build the suite has compiled already
    # and proves the same, instead of compiling the same code again (~50 s on 2 cores).
    same_as_native = not {MNO_FLAG[f] for f in build.ISA_FLAGS[isa]} & _host_flags()
    env = {**os.environ, "QWEN3_CPU_ISA": "native" if same_as_native else isa, "ATEN_CPU_CAPABILITY": "avx2"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(a8w8_ckpt), str(tmp_path / "w4a16.pt")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert res["layout"] == [16, 4], f"{isa}: the A8W8 packing of another path was built (zmm: 64-row panels)"
    assert res["reads_colsum"] is reads_colsum, f"{isa}: the A8W8 code of another path was built"
    assert res["a8w8_mismatches"] == []
    assert res["w4a16_equal"] == [True] * 4, f"{isa}: W4A16 bits differ from the native build's"
    assert res["route_path"] == "AVX2" and res["route_equal"], f"{isa}: the MoE routing's AVX2 path"
    assert all(len(r) == 12 for r in res["batched"])
    assert res["alone"] == res["batched"] == res["again"] == res["python_loop"]
