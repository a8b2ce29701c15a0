"""The reference kernel set: pure PyTorch, correct on any device, the yardstick for every other set.

`reference.<op>` is each operation (reference/ops.py); `KERNELS` is the set filling the contract.
"""
from __future__ import annotations

from ..contract import Kernels
from .ops import (a8w8_linear, add_rms_norm, attend, float_linear, gather_context, int8_matmul, paged_attention,
                  qk_norm_rope, quantize_per_token, rms_norm, rotary, rotary_cos_sin, silu_mul, tq_paged_attention,
                  tq_write, write_kv)
from .w4a16 import w4a16_dequantize, w4a16_linear, w4a16_prepare
from .w4a8 import w4a8_linear, w4a8_prepare
# the layout and codec helpers the reference is built on, reachable as reference.<name> like its ops
from ...kv_cache.layout import key_blocks_to_rows
from ...kv_cache.tq_codec import tq_encode, tq_unpack

__all__ = ["KERNELS", "a8w8_linear", "add_rms_norm", "attend", "float_linear", "gather_context", "int8_matmul",
           "paged_attention", "qk_norm_rope", "quantize_per_token", "rms_norm", "rotary", "rotary_cos_sin",
           "silu_mul", "tq_paged_attention", "tq_write", "w4a16_dequantize", "w4a16_linear", "w4a16_prepare", "w4a8_linear", "w4a8_prepare", "write_kv",
           "key_blocks_to_rows", "tq_encode", "tq_unpack"]

KERNELS = Kernels(
    name="reference",
    rms_norm=rms_norm,
    add_rms_norm=add_rms_norm,
    qk_norm_rope=qk_norm_rope,
    silu_mul=silu_mul,
    a8w8_prepare=lambda w_q, w_scale: (w_q, w_scale),
    a8w8_linear=lambda x, prepared: a8w8_linear(x, *prepared),
    w4a16_prepare=w4a16_prepare,
    w4a16_linear=w4a16_linear,
    float_prepare=lambda w: w,
    float_linear=float_linear,
    float_rows=lambda w, ids: w.index_select(0, ids),
    write_kv=write_kv,
    paged_attention=paged_attention,
    tq_write=tq_write,
    tq_paged_attention=tq_paged_attention,
)
