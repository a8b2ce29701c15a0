"""Content hashes of full KV pages for prefix caching: page i's hash is chained over the hash of page i-1
and page i's token ids, from a root that holds whatever else decides the pages' contents (the cache kind
and its seeds, the model dtype), the request's cache_salt, so tenants with different salts never
share a page, and the content digest of its LoRA adapter, so two adapters (or an adapter and the base)
never share one. BLAKE2b (16 bytes): fast, and collisions are out of reach."""
from __future__ import annotations

import hashlib
from array import array


def root_hash(content_key: str, cache_salt: str | None, adapter: str | None = None) -> bytes:
    key = f"{content_key}\0{'' if cache_salt is None else 'salt:' + cache_salt}"
    if adapter is not None:
        key += f"\0lora:{adapter}"
    return hashlib.blake2b(key.encode("utf-8"), digest_size=16).digest()


def extend_hashes(hashes: list[bytes], root: bytes, tokens: list[int], page_size: int, num_pages: int) -> None:
    """Appends to `hashes` (the chain so far) until it covers the first `num_pages` full pages of `tokens`."""
    while len(hashes) < num_pages:
        i = len(hashes)
        parent = hashes[-1] if hashes else root
        page = array("q", tokens[i * page_size:(i + 1) * page_size]).tobytes()
        hashes.append(hashlib.blake2b(parent + page, digest_size=16).digest())


def tail_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The hash of a partial last page: `tokens` (1 to page_size of them) after the chain ending in `parent`
    (a full page's hash, or the root). Domain-separated from full pages: a partial entry is only ever
    copied, never shared (kv_cache/block_manager.py)."""
    return hashlib.blake2b(b"tail\0" + parent + array("q", tokens).tobytes(), digest_size=16).digest()
