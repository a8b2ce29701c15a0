"""What every Triton kernel of this set shares: the interpreter switch and the rounding helpers.

`TRITON_INTERPRET=1` runs the kernels on CPU tensors through Triton's numpy interpreter (how the CPU-only CI
proves them). Three interpreter traps need code that is also right on a GPU (shared spec gpu.md):
- a bf16 `tl.dot` multiplies raw bit patterns under the interpreter: `fdot` upcasts and, interpreted,
  sums explicit products (the same order for every row, so rows stay batch invariant there too);
- fp32 -> bf16 `.to()` truncates under the interpreter: `round_out` rounds to nearest even with integer ops;
- libdevice (`rint`) is not patched: `rne` rounds to nearest even with the 1.5 * 2**23 trick.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_OUT_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def out_code(dtype: torch.dtype) -> int:
    """The constexpr `round_out` takes for a tensor of this dtype."""
    try:
        return _OUT_CODES[dtype]
    except KeyError:
        raise TypeError(f"kernels triton: unsupported dtype {dtype}") from None


@triton.jit
def rne(t):
    """fp32 round half to even for |t| < 2**22 (what torch.round does), with no libdevice call."""
    return (t + 12582912.0) - 12582912.0


@triton.jit
def round_out(x, OUT: tl.constexpr):
    """fp32 -> the store dtype (0 fp32, 1 bf16, 2 fp16), rounding to nearest even like torch's `.to()`."""
    if OUT == 1:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        return b.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif OUT == 2:
        return x.to(tl.float16)
    else:
        return x


@triton.jit
def fdot(a, b, INTERP: tl.constexpr, IEEE: tl.constexpr):
    """[M, K] x [K, N] -> fp32 [M, N], fp32 accumulation. IEEE: fp32 operands at full precision (no TF32)."""
    if INTERP:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    elif IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)
