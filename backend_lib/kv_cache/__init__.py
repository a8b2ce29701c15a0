"""Paged KV caches (dense and TurboQuant) behind one interface, the page allocator and memory-budget sizing."""
from .base import KV_CACHES, KVCache, cache_class
from .block_manager import BlockManager
from .dense import DenseKVCache
from .metadata import AttentionMetadata
from .pool import KV_CACHE_KINDS, allocate_kv_cache
from .turboquant import TurboQuantKVCache

__all__ = ["AttentionMetadata", "BlockManager", "DenseKVCache", "KVCache", "KV_CACHES", "KV_CACHE_KINDS",
           "TurboQuantKVCache", "allocate_kv_cache", "cache_class"]
