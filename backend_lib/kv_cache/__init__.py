"""Paged KV caches (dense and TurboQuant), the page allocator and memory-budget sizing."""
from .block_manager import BlockManager
from .dense import DenseKVCache
from .metadata import AttentionMetadata
from .pool import KV_CACHE_KINDS, allocate_kv_cache

__all__ = ["AttentionMetadata", "BlockManager", "DenseKVCache", "KV_CACHE_KINDS", "allocate_kv_cache"]
