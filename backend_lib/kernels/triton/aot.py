"""Ahead-of-time compilation of every kernel variant the engine launches, for a GPU target, on any machine.

`triton.compile` with a `GPUTarget` builds PTX and a cubin with no GPU present; the bundled ptxas (-v) reports
registers and spill bytes; the compiled metadata the shared memory. Variants: the launch configurations of
linear.py / w4a16.py / norm.py / attention.py (imported with TRITON_INTERPRET unset, so they are the GPU ones) at the
shapes of Qwen3-0.6B, 8B and 14B (GQA groups 2, 4, 5) in bf16 with the default page size, dense and TurboQuant KV,
and the fused MoE kernels (moe.py) at each of their tile buckets.

    python -m backend_lib.kernels.triton.aot [--arch 90 --arch 80] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

# sm_80 / sm_90: the most dynamic shared memory one block may use
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
# Qwen3-0.6B and Qwen3-8B: hidden, heads, kv heads, head_dim, intermediate
SHAPES = {"0.6b": (1024, 16, 8, 128, 3072), "8b": (4096, 32, 8, 128, 12288), "14b": (5120, 40, 8, 128, 17408)}
PAGE = 128
MOE_HIDDEN = (2048, 4096)     # Qwen3-30B-A3B, Qwen3-235B-A22B


@dataclass
class Variant:
    kernel: str                      # module.function
    signature: dict
    constexprs: dict
    options: dict = field(default_factory=dict)
    label: str = ""


def _sig(names, types: dict, constexprs: dict) -> dict:
    """Signature in argument order: constexprs marked, the rest from types (default i32)."""
    return {n: ("constexpr" if n in constexprs else types.get(n, "i32")) for n in names}


def variants() -> list[Variant]:
    os.environ.pop("TRITON_INTERPRET", None)
    import triton

    from ...kv_cache.layout import key_block_width
    from . import attention, linear, moe, norm, w4a16

    out: list[Variant] = []

    def add(fn, types, constexprs, options, label):
        opts = {k: options[k] for k in ("num_warps", "num_stages") if k in options}
        ce = {k: v for k, v in constexprs.items() if k not in ("num_warps", "num_stages")}
        out.append(Variant(f"{fn.__module__}.{fn.__name__}", _sig(fn.arg_names, types, ce), ce, opts, label))

    bf = "*bf16"
    for m in linear.A8W8_BUCKETS:
        cfg = linear.a8w8_config(m)
        for even in (True, False):
            add(linear.a8w8_kernel, {"x_ptr": bf, "w_ptr": "*i8", "ws_ptr": "*fp32", "y_ptr": bf},
                {**cfg, "OUT": 1, "EVEN_K": even}, cfg, f"a8w8 M={m} even_k={even}")
    for out_dtype, code in (("bf16", 1), ("fp32", 0)):     # the layers and the fp32 logits of lm_head
        cfg = linear.FLOAT_CONFIG
        add(linear.float_linear_kernel, {"x_ptr": bf, "w_ptr": bf, "y_ptr": f"*{out_dtype}"},
            {**cfg, "OUT": code, "INTERP": False, "PREC": 0}, cfg, f"float_linear out={out_dtype}")
    # int4 weight-only (w4a16.py): one tiling for every M; a group a multiple of BLOCK_K (one [BLOCK_N] load of
    # scales / zeros per tile) or not (gathered per element: group 16, channel-wise over a K no multiple of it),
    # with and without the act-order perm
    cfg = w4a16.W4A16_CONFIG
    for tile_group in (True, False):
        for has_perm in (False, True):
            add(w4a16.w4a16_kernel, {"x_ptr": bf, "w_ptr": "*u8", "s_ptr": "*fp32", "z_ptr": "*fp32",
                                     "perm_ptr": "*i32", "y_ptr": bf},
                {**cfg, "OUT": 1, "HAS_PERM": has_perm, "TILE_GROUP": tile_group, "INTERP": False}, cfg,
                f"w4a16 tile_group={tile_group} perm={has_perm}")
    # the fused MoE (moe.py): gate/up + SwiGLU and down + router weight, A8W8 at each tile bucket and bf16 experts,
    # and the combine at Qwen3-30B-A3B / 235B-A22B's hidden sizes (8 experts per token)
    moe_sig = {"a_ptr": bf, "ws_ptr": "*fp32", "wz_ptr": "*fp32", "pw_ptr": bf, "y_ptr": bf, "sorted_ptr": "*i32",
               "bexp_ptr": "*i32", "npad_ptr": "*i32", "perm_ptr": "*i32"}
    no_perm = {"HAS_PERM": False, "PERM_UP": False}
    for quant in (True, False):
        for pairs, experts in moe.MOE_BUCKETS if quant else moe.MOE_BUCKETS[:1]:
            for gated in (True, False):
                cfg = moe.moe_config(quant, pairs, experts, gated)
                add(moe.moe_gemm_kernel, {**moe_sig, "w_ptr": "*i8" if quant else bf},
                    {**cfg, "A_DIV": 8 if gated else 1, "QUANT": quant, "GATED": gated, "MUL_W": not gated,
                     "EVEN_K": True, "OUT": 1, "INTERP": False, "PREC": 0, "W4": False, "TILE_GROUP": False,
                     **no_perm}, cfg,
                    f"moe {'a8w8' if quant else 'bf16'} {'gate_up+swiglu' if gated else 'down+weight'} "
                    f"BLOCK_M={cfg['BLOCK_M']}")
    # packed int4 experts (W4A16): full fp32 dot; a group per K tile (group 128) or gathered; without and with
    # GPTQ act order (the rows gathered through each expert's perm; gate/up: one perm shared, or each its own)
    for gated in (True, False):
        cfg = moe.moe_config(False, 1, 128, gated, w4=True)
        for tile_group in (True, False):
            for perm in ("", "shared", "own") if gated else ("", "own"):
                add(moe.moe_gemm_kernel, {**moe_sig, "w_ptr": "*u8"},
                    {**cfg, "A_DIV": 8 if gated else 1, "QUANT": False, "GATED": gated, "MUL_W": not gated,
                     "EVEN_K": True, "OUT": 1, "INTERP": False, "PREC": 1, "W4": True, "TILE_GROUP": tile_group,
                     "HAS_PERM": bool(perm), "PERM_UP": gated and perm == "own"}, cfg,
                    f"moe w4a16 {'gate_up+swiglu' if gated else 'down+weight'} tile_group={tile_group}"
                    + (f" perm={perm}" if perm else ""))
    for hid in MOE_HIDDEN:
        block = min(moe.COMBINE_BLOCK, triton.next_power_of_2(hid))
        add(moe.moe_combine_kernel, {"c_ptr": bf, "y_ptr": bf}, {"TOPK": 8, "BLOCK": block, "OUT": 1}, {},
            f"moe combine hidden={hid}")
    seen = set()
    for name, (hid, h, kvh, d, inter) in SHAPES.items():
        import triton

        for add_ in (False, True):
            key = ("rms", hid, add_)
            if key not in seen:
                seen.add(key)
                add(norm.rms_norm_kernel, {"x_ptr": bf, "r_ptr": bf, "w_ptr": bf, "y_ptr": bf, "h_ptr": bf,
                                           "eps": "fp32"},
                    {"BLOCK": triton.next_power_of_2(hid), "ADD": add_, "XD": 1, "OUT": 1},
                    norm.row_warps(triton.next_power_of_2(hid)), f"rms_norm {name} add={add_}")
        if ("qk", d) not in seen:
            seen.add(("qk", d))
            add(norm.qk_norm_rope_kernel, {"qkv_ptr": bf, "qw_ptr": bf, "kw_ptr": bf, "pos_ptr": "*i64",
                                           "cs_ptr": "*fp32", "q_ptr": bf, "k_ptr": bf, "eps": "fp32"},
                {"D": d, "HALF": d // 2, "XD": 1, "HB": norm.QK_HEADS}, {}, "qk_norm_rope")
            add(norm.silu_mul_kernel, {"x_ptr": bf, "y_ptr": bf}, {"BLOCK": 1024, "XD": 1}, {}, "silu_mul")
            add(attention.write_kv_kernel, {"k_ptr": bf, "v_ptr": bf, "kc_ptr": bf, "vc_ptr": bf,
                                            "slot_ptr": "*i64"},
                {"D": d, "PAGE": PAGE, "KW": 1}, {}, "write_kv")      # the set's own row-by-row layout
            for o, code in (("fp32", 0), ("bf16", 1)):
                add(attention.rotate_kernel, {"x_ptr": "*fp32", "r_ptr": "*fp32", "y_ptr": f"*{o}"},
                    {"D": d, "BLOCK_M": 16, "BLOCK_K": min(d, 32), "OUT": code, "INTERP": False}, {},
                    f"tq rotate out={o}")
            for cb in (key_block_width(PAGE), 1):
                add(attention.tq_write_kernel, {"x_ptr": bf, "codes_ptr": "*u8", "scales_ptr": "*fp32",
                                                "slot_ptr": "*i64", "r_ptr": "*fp32", "cent_ptr": "*fp32",
                                                "bnd_ptr": "*fp32"},
                    {"HALF": d // 2, "PAGE": PAGE, "KW": key_block_width(PAGE), "CB": cb}, {}, f"tq_write cb={cb}")
        g = h // kvh
        for tq in (False, True):
            if ("att", g, tq) in seen:
                continue
            seen.add(("att", g, tq))
            kv = "*u8" if tq else bf
            for split in (False, True):     # a program walks its splits / one program per split (decode)
                add(attention.attention_kernel,
                    {"q_ptr": "*fp32" if tq else bf, "o_ptr": "*fp32" if tq else bf, "k_ptr": kv, "v_ptr": kv,
                     "ks_ptr": "*fp32", "vs_ptr": "*fp32", "cent_ptr": "*fp32", "bt_ptr": "*i32", "qsl_ptr": "*i32",
                     "lens_ptr": "*i32", "ws_ptr": "*fp32", "sm_scale": "fp32"},
                    {"G": g, "GP": triton.next_power_of_2(g), "HALF": d // 2, "PAGE": PAGE,
                     "KW": key_block_width(PAGE) if tq else 1,   # TQ codes blocked; dense K row by row
                     "TQ": tq, "OUT": 0 if tq else 1, "PD": 0 if tq else 1, "INTERP": False, "PREC": 0,
                     "SPLIT": attention.SPLIT, "SPLIT_PROGRAMS": split, **attention.tile(g, tq)},
                    attention.GPU_LAUNCH,
                    f"attention {'tq' if tq else 'bf16'} group={g}{' split programs' if split else ''}")
            if ("combine", d, tq) not in seen:
                seen.add(("combine", d, tq))
                add(attention.combine_kernel, {"ws_ptr": "*fp32", "o_ptr": "*fp32" if tq else bf, "lens_ptr": "*i32"},
                    {"HALF": d // 2, "SPLIT": attention.SPLIT, "OUT": 0 if tq else 1}, {},
                    f"attention combine {'tq' if tq else 'bf16'} d={d}")
    return out


def _ptxas() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def compile_variant(v: Variant, arch: int) -> dict:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mod, _, name = v.kernel.rpartition(".")
    fn = getattr(importlib.import_module(mod), name)
    k = triton.compile(ASTSource(fn=fn, signature=v.signature, constexprs=v.constexprs),
                       target=GPUTarget("cuda", arch, 32), options=v.options)
    ptx = k.asm["ptx"]
    # the bundled ptxas, verbose, on the same PTX for the same target: registers and spill bytes
    with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as f:
        f.write(ptx)
        f.flush()
        gpu = re.search(r"^\.target (\S+)", ptx, re.M).group(1)
        info = subprocess.run([_ptxas(), "--gpu-name", gpu, "-v", f.name, "-o", os.devnull], capture_output=True,
                              text=True, check=True)
    text = info.stdout + info.stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return {"kernel": name, "label": v.label, "arch": arch, "options": v.options,
            "registers": int(re.search(r"Used (\d+) registers", text).group(1)),
            "spill_stores": int(spills.group(1)), "spill_loads": int(spills.group(2)),
            "shared": k.metadata.shared, "shared_limit": SHARED_LIMIT[arch],
            "mma": sorted(set(re.findall(r"\b((?:wgmma\.mma_async|mma\.sync)\.[\w.]+)", ptx)))}


def _one(args):
    os.environ.pop("TRITON_INTERPRET", None)
    v, arch = args
    return compile_variant(v, arch)


def compile_all(archs=(90, 80), workers: int = 2) -> list[dict]:
    jobs = [(v, a) for a in archs for v in variants()]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(_one, jobs))


def problems(results: list[dict]) -> list[str]:
    bad = []
    for r in results:
        where = f"{r['label']} sm_{r['arch']}"
        if r["spill_stores"] or r["spill_loads"]:
            bad.append(f"{where}: register spills ({r['spill_stores']} bytes stored, {r['spill_loads']} loaded)")
        if r["shared"] > r["shared_limit"]:
            bad.append(f"{where}: {r['shared']} bytes of shared memory > {r['shared_limit']}")
        int8 = r["kernel"] == "a8w8_kernel" or (r["kernel"] == "moe_gemm_kernel" and "a8w8" in r["label"])
        if int8 and not any(".s8" in i for i in r["mma"]):
            bad.append(f"{where}: the int8 GEMM uses no int8 MMA instruction")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, action="append", help="compute capability x10 (default 90 and 80)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    results = compile_all(tuple(args.arch or (90, 80)), args.workers)
    bad = problems(results)
    if args.json:
        print(json.dumps({"results": results, "problems": bad}))
    else:
        for r in results:
            print(f"{r['label']:<36} sm_{r['arch']} regs {r['registers']:>3} spills {r['spill_stores']:>4} "
                  f"shared {r['shared']:>6} {' '.join(r['mma'])[:60]}")
        for b in bad:
            print("PROBLEM:", b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
