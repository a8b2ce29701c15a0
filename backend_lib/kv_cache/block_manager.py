"""Page allocation for the paged KV cache: a free list and one block table per sequence."""
from __future__ import annotations


class BlockManager:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError("BlockManager needs positive num_pages and page_size")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low page ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return (num_tokens + self.page_size - 1) // self.page_size

    def extra_pages(self, block_table: list[int], num_tokens: int) -> int:
        """Pages to add to block_table so that it holds num_tokens."""
        return max(0, self.pages_for(num_tokens) - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.extra_pages(block_table, num_tokens) <= len(self._free)

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        need = self.extra_pages(block_table, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"KV cache: {need} pages needed, {len(self._free)} free")
        for _ in range(need):
            block_table.append(self._free.pop())

    def free(self, block_table: list[int]) -> None:
        while block_table:
            self._free.append(block_table.pop())
