"""The pool of KV blocks: reference counts, the free queue, and the map from content hash to cached block.

A block is in use while some sequence holds it (ref_count > 0) and free otherwise.  A free block whose content is
known (it has a hash) is still a cache entry: a new sequence with the same prefix takes it back from the free queue
(`touch`).  Fresh blocks come from the front of the free queue; taking a cached one there evicts it (its hash is
forgotten).  Freed blocks without a hash go to the front (nothing is lost by reusing them first, and their memory is
the warmest); freed cached blocks go to the back, so the cache is evicted least recently freed first.

Cached (full) blocks are immutable: a sequence only writes KV at positions past its computed tokens, and a full
block is hashed only once all its positions are computed with final tokens, so a shared block is never written
again; sharing is copy-on-write by construction, with no copy ever needed (the partial last block is never shared).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from tokenspout.core.block_hash import BlockHash


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("the KV cache budget holds no block; raise --kv-cache-memory")
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front = next to reuse
        self._cached: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}

    @property
    def num_free(self) -> int:
        """Blocks not held by any sequence, cached ones included (they are evicted on demand)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def hash_of(self, block: int) -> BlockHash | None:
        return self._hash_of.get(block)

    def is_free(self, block: int) -> bool:
        return self.ref_count[block] == 0

    def take(self, n: int) -> list[int]:
        """n fresh blocks (ref_count 1) from the front of the free queue, evicting cached ones; the caller has
        checked num_free."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            h = self._hash_of.pop(block, None)
            if h is not None:
                del self._cached[h]
            self.ref_count[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        """One more holder for each of these cached blocks (out of the free queue when they were free)."""
        for b in blocks:
            if self.ref_count[b] == 0:
                del self._free[b]
            self.ref_count[b] += 1

    def release(self, blocks: list[int]) -> None:
        """One holder fewer for each block of a sequence (given in sequence order).  Blocks nobody holds become
        free: the sequence's tail first in eviction order, so a shared head (a common prompt) outlives its tails."""
        for b in reversed(blocks):
            self.ref_count[b] -= 1
            if self.ref_count[b] < 0:
                raise RuntimeError(f"block {b} released more often than taken")
            if self.ref_count[b] == 0:
                self._free[b] = None
                if b not in self._hash_of:
                    self._free.move_to_end(b, last=False)

    def cache(self, block: int, block_hash: BlockHash) -> bool:
        """Records the content of a held, fully computed block.  False (and nothing recorded) when another block
        already holds that content: two sequences computed the same prefix in one step; the second copy stays
        private and is reused as a plain block once freed."""
        if block_hash in self._cached or block in self._hash_of:
            return False
        self._cached[block_hash] = block
        self._hash_of[block] = block_hash
        return True
