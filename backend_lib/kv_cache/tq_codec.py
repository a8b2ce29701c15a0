"""The TurboQuant codec (MSE variant): a seeded rotation per layer and a 16-level Lloyd-Max codebook of
N(0, 1/head_dim); rows become nibble codes plus one fp32 scale. Pure PyTorch: the kernels and the
TurboQuant cache use it, tests compare against it."""
from __future__ import annotations

import torch

# Lloyd-Max 16-level quantizer of N(0, 1): the positive centroids (symmetric), MSE 0.009501.
LLOYD_MAX_16 = (0.1283950, 0.3880483, 0.6567591, 0.9423405, 1.2562312, 1.6180464, 2.0690172, 2.7325896)


def tq_codebook(head_dim: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(centroids [16], boundaries [15]) for N(0, 1/head_dim): ascending, boundaries are midpoints."""
    pos = torch.tensor(LLOYD_MAX_16, dtype=torch.float64)
    cents = torch.cat([-pos.flip(0), pos]) / head_dim ** 0.5
    bounds = (cents[1:] + cents[:-1]) / 2
    return cents.float().to(device), bounds.float().to(device)


def tq_rotation(head_dim: int, seed: int) -> torch.Tensor:
    """A seeded random orthogonal [d, d] matrix: QR of a standard-normal matrix, signs fixed by diag(R)."""
    g = torch.Generator(device="cpu").manual_seed(seed % 2**63)
    a = torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    q = q * torch.sign(torch.diagonal(r))[None, :]
    return q.float().contiguous()


def tq_layer_seed(base_seed: int, layer: int) -> int:
    return (base_seed * 1_000_003 + layer * 7919 + 17) % 2**63


def tq_encode(x: torch.Tensor, rotation: torch.Tensor, centroids: torch.Tensor, boundaries: torch.Tensor):
    """Rows x [..., d] -> (codes uint8 [..., d/2] half/half nibble order, scales fp32 [...])."""
    xf = x.float()
    d = xf.shape[-1]
    n = torch.sqrt(xf.pow(2).sum(-1) + 1e-6)
    y = (xf / n[..., None]) @ rotation
    idx = torch.bucketize(y, boundaries)                    # index of the nearest centroid
    norm_c = centroids[idx].pow(2).sum(-1).sqrt()
    scale = n / norm_c
    codes = (idx[..., : d // 2] | (idx[..., d // 2:] << 4)).to(torch.uint8)
    return codes, scale


def tq_unpack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., d/2] -> centroid indices int64 [..., d]."""
    c = codes.long()
    return torch.cat([c & 0xF, c >> 4], dim=-1)


def tq_decode(codes, scales, rotation, centroids) -> torch.Tensor:
    """Back to the original space (only for tests and the dequantize-then-attend comparison)."""
    return (centroids[tq_unpack(codes)] * scales[..., None]) @ rotation.t()
