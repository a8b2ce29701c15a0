"""The Triton kernel set: every slot of the contract through the custom ops of ops.py."""
from __future__ import annotations

from ..contract import Kernels
from ..moe import grouped_moe
from . import ops
from .attention import kv_shapes
from .experts import PackedExperts, fused_moe, moe_weights
from .w4a16 import w4a16_prepare


def _qk_norm_rope(qkv, q_w, k_w, positions, cos_sin, num_heads, num_kv_heads, eps):
    q, k = ops.qk_norm_rope(qkv, q_w, k_w, positions, cos_sin, num_heads, num_kv_heads, eps)
    d = cos_sin.shape[1]
    # a view, as the reference's; narrow rather than [:, a:], which fake CUDA tensors of a CPU-only torch
    # (tests/test_no_host_sync.py) cannot index
    v = qkv.narrow(1, (num_heads + num_kv_heads) * d, num_kv_heads * d).reshape(qkv.shape[0], num_kv_heads, d)
    return q, k, v


def _moe(x, topk_ids, topk_weights, experts):
    if isinstance(experts, PackedExperts):
        return fused_moe(x, topk_ids, topk_weights, experts)
    return grouped_moe(KERNELS, x, topk_ids, topk_weights, experts)


KERNELS = Kernels(
    name="triton",
    rms_norm=ops.rms_norm,
    add_rms_norm=ops.add_rms_norm,
    qk_norm_rope=_qk_norm_rope,
    silu_mul=ops.silu_mul,
    a8w8_prepare=lambda w_q, w_scale: (w_q.contiguous(), w_scale.float().contiguous()),
    a8w8_linear=lambda x, prepared: ops.a8w8_linear(x, *prepared),
    # int4 weight-only: the weight kept packed two codes a byte, dequantized in registers (w4a16.py)
    w4a16_prepare=w4a16_prepare,
    w4a16_linear=lambda x, prepared: ops.w4a16_linear(x, *prepared),
    float_prepare=lambda w: w.contiguous(),
    float_linear=lambda x, w, out_dtype=None: ops.float_linear(x, w, out_dtype),
    float_rows=lambda w, ids: w.index_select(0, ids),
    write_kv=ops.write_kv,
    paged_attention=ops.paged_attention,
    tq_write=ops.tq_write,
    tq_paged_attention=ops.tq_paged_attention,
    kv_shapes=kv_shapes,
    moe=_moe,
    moe_weights=moe_weights,
)
