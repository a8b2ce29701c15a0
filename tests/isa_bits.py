"""The CPU kernel set built for one instruction set (AVX-512, AVX2 or scalar) on this machine, and the outputs of
its SIMD ops on fixed seeded inputs: a tool to check that a change of csrc/ leaves every ISA build's bits as they
were (the builds differ from one another: their sums run over 16, 8 or 1 lanes).

    python tests/isa_bits.py dump --isa avx2 --csrc backend_lib/kernels/cpu/csrc --out /tmp/after_avx2.pt
    python tests/isa_bits.py compare /tmp/before_avx2.pt /tmp/after_avx2.pt
    python tests/isa_bits.py moe --isa scalar     # that build's MoE op (csrc/moe.cpp) = its composed slot

dump builds every .cpp of --csrc with the kernel set's flags plus the ISA's -mno-* flags into a build folder of
its own (keyed by the sources and flags, so an unchanged tree is not rebuilt), loads it as torch.ops.qwen3_cpu
in this process (run one ISA per process) and saves the outputs: dense and TurboQuant paged attention (prefill
chunks and decode, fp32 / bf16, head dims 32 / 64 / 80 / 96 / 128, page sizes 16 / 32, GQA groups 1 to 8), the row ops
(RMSNorm, add + RMSNorm, q/k-norm + RoPE, SwiGLU), the float / A8W8 / W4A16 linears, and the engine's layer
loop (csrc/decode_layers.cpp) over a tiny A8W8 checkpoint: hidden states of every step and the greedy ids.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# This tool's names for the kernel set's $QWEN3_CPU_ISA builds (backend_lib/kernels/cpu/build.py, ISA_FLAGS: the one
# home of their flags); "avx512" is the native build of an AVX-512 host.
ISAS = {"avx512": "native", "avx2vnni": "avx2vnni", "avx2": "avx2", "scalar": "scalar"}


def build(csrc: Path, isa: str, cache: Path, build_dir: Path | None = None) -> None:
    import torch
    from torch.utils import cpp_extension

    from backend_lib.kernels.cpu import build as kbuild

    sources = sorted(p for p in csrc.iterdir() if p.suffix == ".cpp")
    flags = kbuild._cflags(ISAS[isa])
    h = hashlib.sha256(" ".join(flags).encode())
    for p in sorted(csrc.iterdir()):
        if p.suffix in (".cpp", ".h"):
            h.update(p.name.encode() + p.read_bytes())
    out = build_dir or cache / f"{isa}_{h.hexdigest()[:12]}"
    so = out / "qwen3_cpu.so"
    if so.exists() and build_dir is None:
        torch.ops.load_library(str(so))
        return
    out.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(name="qwen3_cpu", sources=[str(s) for s in sources], extra_cflags=flags,
                       extra_ldflags=["-fopenmp"], build_directory=str(out), is_python_module=False, verbose=False)


def _cache_of(torch, D, S, pages, KVH, dtype):
    KW = 32 if S % 32 == 0 else 16
    k = torch.randn(pages, KVH, S // KW, D, KW).to(dtype)
    v = torch.randn(pages, KVH, S, D).to(dtype)
    return k, v


def _batch(torch, g, lens, news, S, pages):
    """block tables (a random permutation of pages), query_start_loc and seq_lens for sequences of lens[i] keys
    of which the last news[i] are this step's queries."""
    maxp = max(-(-n // S) for n in lens)
    perm = torch.randperm(pages, generator=g)
    bt = perm[: len(lens) * maxp].reshape(len(lens), maxp).to(torch.int32)
    qsl = torch.tensor([0] + list(news)).cumsum(0).to(torch.int32)
    return bt, qsl, torch.tensor(lens, dtype=torch.int32)


ATTN_CASES = [  # (D, S, H, KVH, lens, news)
    (128, 16, 16, 8, [37], [37]),                  # prefill, G = 2, KW 16
    (128, 32, 16, 8, [1, 70, 300], [1, 40, 1]),    # mixed, KW 32
    (128, 32, 32, 4, [45, 129], [1, 1]),           # decode, G = 8
    (128, 16, 16, 16, [200], [1]),                 # decode, G = 1
    (128, 32, 8, 2, [96], [96]),                   # prefill, G = 4 (32 rows an item / 8)
    (64, 16, 8, 2, [33, 77], [33, 1]),             # D 64
    (64, 32, 16, 4, [260], [1]),
    (80, 16, 8, 4, [50, 19], [50, 2]),             # D 80: no 32-dim pairs (the AVX2 16-dim path, scalar values)
    (96, 32, 6, 2, [65], [65]),                    # D 96, G 3
    (32, 16, 4, 2, [40, 7], [40, 1]),              # D 32 (the tiny checkpoints')
    (32, 32, 8, 2, [100, 3], [1, 3]),
]


def dump(out_path: str) -> None:
    import torch

    ops = torch.ops.qwen3_cpu
    res: dict[str, torch.Tensor] = {}
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    for ci, (D, S, H, KVH, lens, news) in enumerate(ATTN_CASES):
        pages = len(lens) * max(-(-n // S) for n in lens) + 3
        bt, qsl, sl = _batch(torch, g, lens, news, S, pages)
        for qdt, cdt in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                         (torch.float32, torch.bfloat16)):
            kc, vc = _cache_of(torch, D, S, pages, KVH, cdt)
            q = (torch.randn(int(qsl[-1]), H, D) * 2).to(qdt)
            res[f"attn{ci}_{qdt}_{cdt}"] = ops.paged_attention(q, kc, vc, bt, qsl, sl, D ** -0.5)
        # write_kv then attention over the written rows
        kc, vc = _cache_of(torch, D, S, pages, KVH, torch.bfloat16)
        T = int(qsl[-1])
        slots = torch.cat([bt[b].long()[pos // S] * S + pos % S
                           for b, pos in ((b, torch.arange(lens[b] - news[b], lens[b])) for b in range(len(lens)))])
        ops.write_kv(torch.randn(T, KVH, D), torch.randn(T, KVH, D), kc, vc, slots)
        res[f"writekv{ci}"] = torch.cat([kc.flatten().float(), vc.flatten().float()])
        # TurboQuant: encode rows of every slot, then attention
        if D % 2 == 0:
            KW = 32 if S % 32 == 0 else 16
            R = torch.linalg.qr(torch.randn(D, D, generator=g))[0].contiguous()
            cents = torch.sort(torch.randn(16, generator=g) * 0.2)[0].contiguous()
            bounds = ((cents[1:] + cents[:-1]) / 2).contiguous()
            kcodes = torch.zeros(pages, KVH, S // KW, D // 2, KW, dtype=torch.uint8)
            vcodes = torch.zeros(pages, KVH, S, D // 2, dtype=torch.uint8)
            ks, vs = torch.zeros(pages, KVH, S), torch.zeros(pages, KVH, S)
            all_slots = torch.arange(pages * S)
            for dt in (torch.float32, torch.bfloat16):
                ops.tq_write(torch.randn(pages * S, KVH, D).to(dt), torch.randn(pages * S, KVH, D).to(dt), kcodes, ks,
                             vcodes, vs, all_slots, R, cents, bounds)
                res[f"tqwrite{ci}_{dt}"] = torch.cat([kcodes.flatten().float(), vcodes.flatten().float(), ks.flatten(),
                                                      vs.flatten()])
                q = (torch.randn(T, H, D) * 2).to(dt)
                res[f"tq{ci}_{dt}"] = ops.tq_paged_attention(q, kcodes, ks, vcodes, vs, bt, qsl, sl, R, cents, D ** -0.5)
    # row ops
    for dt in (torch.float32, torch.bfloat16):
        for D in (128, 1024, 72, 1000):
            x, r, w = (torch.randn(5, D) * 3).to(dt), torch.randn(5, D).to(dt), torch.randn(D).to(dt)
            res[f"rms_{dt}_{D}"] = ops.rms_norm(x, w, 1e-6)
            res[f"addrms_{dt}_{D}"] = torch.cat(list(ops.add_rms_norm(x, r, w, 1e-6)))
        for I in (512, 200, 7):
            x = (torch.randn(4, 2 * I) * 4).to(dt)
            x[0, :5] = torch.tensor([-100.0, -87.5, 88.5, 0.0, -0.0])
            res[f"silu_{dt}_{I}"] = ops.silu_mul(x)
        for D in (128, 64):
            H, KVH, T = 4, 2, 3
            qkv = torch.randn(T, (H + 2 * KVH) * D).to(dt)
            cs = torch.randn(64, D)
            pos = torch.tensor([0, 17, 63])
            res[f"qkrope_{dt}_{D}"] = torch.cat([t.flatten() for t in ops.qk_norm_rope(
                qkv, torch.randn(D).to(dt), torch.randn(D).to(dt), pos, cs, H, KVH, 1e-6)])
    # linears
    for wdt in (torch.float32, torch.bfloat16):
        for xdt in (torch.float32, torch.bfloat16):
            for M, N, K in ((1, 200, 96), (7, 130, 33), (13, 64, 256)):
                w = torch.randn(N, K).to(wdt)
                x = torch.randn(M, K).to(xdt)
                res[f"lin_{wdt}_{xdt}_{M}_{N}_{K}"] = ops.float_linear(x, ops.float_pack(w), N, None)
    for M, N, K in ((1, 96, 64), (9, 80, 200), (30, 48, 128)):
        wq = torch.randint(-127, 128, (N, K), dtype=torch.int8)
        wsc = torch.rand(N) * 0.01
        for dt in (torch.float32, torch.bfloat16):
            x = torch.randn(M, K).to(dt)
            res[f"a8w8_{dt}_{M}_{N}_{K}"] = ops.a8w8_linear(x, ops.a8w8_pack(wq), wsc, ops.a8w8_colsum(wq))
    from backend_lib.kernels import get_kernels

    cpu = get_kernels("cpu")
    codes = torch.randint(0, 16, (72, 192), dtype=torch.uint8)
    prepared = cpu.w4a16_prepare(codes, torch.rand(72, 3) * 0.05, torch.randint(0, 17, (72, 3)).float(),
                                 torch.randperm(192))
    for M in (1, 9):
        res[f"w4a16_{M}"] = cpu.w4a16_linear(torch.randn(M, 192).to(torch.bfloat16), prepared)
    res.update(_engine())
    torch.save(res, out_path)
    print(f"{len(res)} outputs -> {out_path}")


def _engine() -> dict:
    """The layer loop (decode steps in csrc/decode_layers.cpp, prefill through the ops) on a tiny A8W8 checkpoint,
    bf16 and fp32, dense and TurboQuant KV caches: every step's hidden states and the greedy ids."""
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import make_engine

    from backend_lib.tools.make_demo_checkpoint import build as build_ckpt

    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        ck = build_ckpt(Path(tmp) / "a8w8", "tiny", "a8w8", 0)
        for dtype, kv in (("bfloat16", "bf16"), ("float32", "bf16"), ("bfloat16", "tq")):
            eng = make_engine(ck, dtype=dtype, kv_cache=kv, max_num_seqs=4, kv_cache_memory="4MiB", max_model_len=256)
            model = eng.runner.model
            fwd, outs = model.forward, []

            def record(*a, _fwd=fwd, _outs=outs):
                out = _fwd(*a)
                _outs.append(out.float().clone())
                return out

            model.forward = record
            prompts = [eng.tokenizer.encode("the quick brown fox " * (1 + 3 * i))[: 5 + 17 * i] for i in range(3)]
            params = eng.make_params({"temperature": 0, "max_tokens": 10, "ignore_eos": True})
            got = eng.generate(prompts, params)
            res[f"engine_{dtype}_{kv}_hidden"] = torch.cat([o.flatten() for o in outs])
            res[f"engine_{dtype}_{kv}_ids"] = torch.tensor([t for r in got for t in r["output_ids"]])
    return res


def moe_check() -> int:
    """In this build: the MoE op (csrc/moe.cpp) against the composed slot (kernels/moe.py) over the same build's
    linear ops, bit for bit, for float (bf16 / fp32 weights), A8W8 and W4A16 (symmetric: the batch-1 table lookup,
    asymmetric) experts, fp32 and bf16 activations, one token and a batch, odd widths of the A8W8 panels."""
    import torch

    from backend_lib.kernels import get_kernels
    from backend_lib.kernels.cpu.moe import build_table
    from backend_lib.kernels.moe import grouped_moe
    from backend_lib.layers.linear import A8W8Linear, FloatLinear, W4A16Linear
    from backend_lib.checkpoint.int4 import Int4Weight

    cpu = get_kernels("cpu", "cpu")
    g = torch.Generator().manual_seed(0)
    H, I, E, K = 96, 40, 6, 3

    def lin(kind, n, k):
        if kind in ("bf16", "fp32"):
            w = torch.randn(n, k, generator=g) * 0.1
            return FloatLinear(w.to(torch.bfloat16 if kind == "bf16" else torch.float32), cpu)
        if kind == "a8w8":
            return A8W8Linear(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g),
                              torch.rand(n, generator=g) * 1e-2, cpu)
        groups = k // 8
        zeros = torch.full((n, groups), 8.0) if kind == "w4a16" else torch.randint(0, 16, (n, groups)).float()
        scales = (torch.rand(n, groups, generator=g) * 0.05).to(torch.bfloat16).float()
        return W4A16Linear(Int4Weight(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g), scales, zeros,
                                      8, None), cpu)

    bad = 0
    for kind in ("bf16", "fp32", "a8w8", "w4a16", "w4a16-asym"):
        experts = [(lin(kind, 2 * I, H), lin(kind, H, I)) for _ in range(E)]
        assert build_table(experts) is not None, kind
        for dt in (torch.float32, torch.bfloat16):
            for t in (1, 7):
                x = (torch.randn(t, H, generator=g) * 2).to(dt)
                ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
                w = torch.softmax(torch.randn(t, K, generator=g), -1).to(dt)
                with torch.inference_mode():
                    a = cpu.moe_experts(x, ids, w, experts)
                    b = grouped_moe(cpu, x, ids, w, experts)
                ok = torch.equal(a, b) and bool(a.abs().sum() > 0)
                bad += not ok
                print(f"moe {kind:<10} {str(dt):<14} T={t}: {'equal' if ok else 'DIFFER'}")
    return 1 if bad else 0


def compare(a_path: str, b_path: str) -> int:
    import torch

    a, b = torch.load(a_path), torch.load(b_path)
    bad = [k for k in a if k not in b or a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
           or not torch.equal(a[k].view(torch.uint8) if a[k].is_floating_point() else a[k],
                              b[k].view(torch.uint8) if b[k].is_floating_point() else b[k])]
    bad += [k for k in b if k not in a]
    print(f"{len(a)} outputs, {len(bad)} differ" + (": " + ", ".join(bad) if bad else " (bit for bit equal)"))
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("--isa", choices=sorted(ISAS), required=True)
    d.add_argument("--csrc", default=str(ROOT / "backend_lib/kernels/cpu/csrc"))
    d.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "qwen3_isa_builds"))
    d.add_argument("--build-dir", help="a folder of one's own for this ISA, rebuilt incrementally (ninja)")
    d.add_argument("--out", required=True)
    m = sub.add_parser("moe")
    m.add_argument("--isa", choices=sorted(ISAS), required=True)
    m.add_argument("--csrc", default=str(ROOT / "backend_lib/kernels/cpu/csrc"))
    m.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "qwen3_isa_builds"))
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = p.parse_args()
    if args.cmd == "compare":
        return compare(args.a, args.b)
    if args.cmd == "moe":
        build(Path(args.csrc), args.isa, Path(args.cache))
        return moe_check()
    build(Path(args.csrc), args.isa, Path(args.cache), Path(args.build_dir) if args.build_dir else None)
    dump(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
