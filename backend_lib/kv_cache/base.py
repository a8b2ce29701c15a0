"""The KV-cache interface every paged cache implements, and the registry that picks one by name."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from .metadata import AttentionMetadata


class KVCache(Protocol):
    """A paged KV cache: pages of `page_size` token rows per layer, written and attended by the kernels.

    Constructed as cls(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device, kernels,
    seed=...); `seed` is the base seed of whatever the cache derives at random (TurboQuant's rotations).
    """

    kind: str
    num_pages: int
    page_size: int

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: "torch.dtype") -> int: ...

    @property
    def content_key(self) -> str:
        """What besides the tokens decides a page's contents (cache kind, dtype, seeds)."""

    def write(self, layer: int, k: "torch.Tensor", v: "torch.Tensor", meta: "AttentionMetadata") -> None: ...

    def copy_page(self, src: int, dst: int) -> None:
        """Copies page src into page dst in every layer (a cached partial prompt page, taken by copy)."""

    def attend(self, layer: int, q: "torch.Tensor", meta: "AttentionMetadata", scale: float) -> "torch.Tensor": ...


KV_CACHES: dict[str, type] = {}


def register_kv_cache(kind: str):
    """Class decorator: makes a KVCache implementation selectable as `kv_cache: <kind>`."""
    def wrap(cls):
        cls.kind = kind
        KV_CACHES[kind] = cls
        return cls
    return wrap


def cache_class(kind: str) -> type:
    try:
        return KV_CACHES[kind]
    except KeyError:
        raise ValueError(f"kv_cache: {kind!r} is not one of {', '.join(KV_CACHES)}") from None
