"""Paged KV cache bookkeeping: fixed-size blocks, a free list and one block list per request.

The tensors live in the model runner; this class only hands out block ids.  A request's block list grows as its
tokens are scheduled; freeing returns the blocks to the free list (the next writer overwrites them).
"""

from __future__ import annotations

from collections import deque


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError("the KV cache budget holds no block; raise --kv-cache-memory")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._blocks: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_of(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def blocks_needed(self, request_id: str, num_tokens_total: int) -> int:
        have = len(self._blocks.get(request_id, ()))
        return max(0, -(-num_tokens_total // self.block_size) - have)

    def allocate(self, request_id: str, num_tokens_total: int) -> list[int] | None:
        """Grows the request's blocks to hold num_tokens_total tokens; returns the new block ids, or None if the
        free list is too short (nothing is allocated then)."""
        need = self.blocks_needed(request_id, num_tokens_total)
        if need > len(self._free):
            return None
        new = [self._free.popleft() for _ in range(need)]
        self._blocks.setdefault(request_id, []).extend(new)
        return new

    def free(self, request_id: str) -> None:
        blocks = self._blocks.pop(request_id, None)
        if blocks:
            # Most recently freed first: their memory is the likeliest to be warm in cache.
            self._free.extendleft(reversed(blocks))
