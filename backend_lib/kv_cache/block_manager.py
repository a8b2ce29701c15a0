"""Page allocation for the paged KV cache: a free list, reference counts, and content-addressed caching of
full pages (prefix caching).

With caching on, a full page is identified by a hash chained over the token ids of every page before it
and its own (kv_cache/prefix.py). A page that no running request holds any more keeps its contents and
its hash: it stays cached, evictable least-recently-used, and a later request whose prompt starts with
the same pages takes it instead of computing it again. Only full pages are shared, so no request ever
writes into a page another one reads. Pages available for allocation are the free ones plus the
evictable cached ones.

The partial last page of a prompt is recorded too, under a tail hash (its tokens after the chain of full
pages before it), but it is never shared: a later request with the same whole prompt (n > 1 choices,
concurrent identical requests) gets a copy of it in a page of its own (`pin` keeps the source from being
evicted until the engine has copied it) and then computes only its last token. The owner only ever writes
positions past those tokens, so the recorded ones stay what the hash says.
"""
from __future__ import annotations

from collections import OrderedDict


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = False):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError("BlockManager needs positive num_pages and page_size")
        self.num_pages, self.page_size = num_pages, page_size
        self.caching = enable_prefix_caching
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low page ids first
        self._ref = [0] * num_pages
        self._hash_of: dict[int, bytes] = {}                # cached page -> its hash
        self._page_of: dict[bytes, int] = {}                # hash -> cached page
        self._evictable: OrderedDict[int, None] = OrderedDict()   # cached pages nobody holds, LRU first
        self._tail_of: dict[int, bytes] = {}                # page holding a prompt's partial last page -> hash
        self._tail_page_of: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        """Pages an allocation can take: never used, or cached and held by no request."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Pages held by running requests."""
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._hash_of.keys() | self._tail_of.keys())

    def pages_for(self, num_tokens: int) -> int:
        return (num_tokens + self.page_size - 1) // self.page_size

    def extra_pages(self, block_table: list[int], num_tokens: int) -> int:
        """Pages to add to block_table so that it holds num_tokens."""
        return max(0, self.pages_for(num_tokens) - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.extra_pages(block_table, num_tokens) <= self.num_free

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        need = self.extra_pages(block_table, num_tokens)
        if need > self.num_free:
            raise RuntimeError(f"KV cache: {need} pages needed, {self.num_free} free")
        for _ in range(need):
            block_table.append(self._take())

    def free(self, block_table: list[int]) -> None:
        """Releases a table's pages, last first: a cached tail is evicted before the prefix it extends."""
        while block_table:
            self._release(block_table.pop())

    # ----- prefix caching ---------------------------------------------------------------------------
    def match(self, hashes: list[bytes]) -> list[int]:
        """The cached pages of the longest run of `hashes` from the first (nothing is taken yet)."""
        pages = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def cost_of(self, pages: list[int]) -> int:
        """Pages that acquiring `pages` takes away from num_free (the evictable ones among them)."""
        return sum(1 for p in pages if self._ref[p] == 0)

    def acquire(self, pages: list[int]) -> None:
        """Takes a reference on cached pages (match's result) for a new request."""
        for p in pages:
            if self._ref[p] == 0:
                del self._evictable[p]
            self._ref[p] += 1

    def register(self, page: int, page_hash: bytes) -> None:
        """Records a page that has just become full under its hash (if that content is not cached yet)."""
        if self.caching and page_hash not in self._page_of and page not in self._hash_of:
            self._hash_of[page] = page_hash
            self._page_of[page_hash] = page

    def register_tail(self, page: int, tail_hash: bytes) -> None:
        """Records the page that holds a prompt's partial last page (copied by later requests, never shared)."""
        if self.caching and tail_hash not in self._tail_page_of and page not in self._tail_of:
            self._tail_of[page] = tail_hash
            self._tail_page_of[tail_hash] = page

    def match_tail(self, tail_hash: bytes) -> int | None:
        return self._tail_page_of.get(tail_hash)

    def pin(self, page: int) -> None:
        """A reference that keeps a cached page from eviction (until unpin) while it is copied."""
        self.acquire([page])

    def unpin(self, page: int) -> None:
        self._release(page)

    # ----- internals --------------------------------------------------------------------------------
    def _take(self) -> int:
        if self._free:
            page = self._free.pop()
        else:   # evict the least recently used cached page
            page, _ = self._evictable.popitem(last=False)
            if page in self._hash_of:
                del self._page_of[self._hash_of.pop(page)]
            if page in self._tail_of:
                del self._tail_page_of[self._tail_of.pop(page)]
        self._ref[page] = 1
        return page

    def _release(self, page: int) -> None:
        self._ref[page] -= 1
        if self._ref[page] == 0:
            if page in self._hash_of or page in self._tail_of:
                self._evictable[page] = None
            else:
                self._free.append(page)
