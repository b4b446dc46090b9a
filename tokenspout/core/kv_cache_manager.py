"""Paged KV cache bookkeeping: one block list per sequence over a shared, ref-counted BlockPool, with automatic
prefix caching (vLLM v1's design).

The tensors live in the model runner; this class only hands out block ids.  A sequence's block list grows as its
tokens are scheduled.  With prefix caching on:

* after each step, every block a sequence has filled with computed, final tokens is recorded by the chain hash of
  its content (`cache_full_blocks`); speculative drafts never count, because the scheduler only advances
  `num_computed_tokens` over accepted tokens;
* a sequence entering the running set (new, or resumed after preemption) starts from the longest run of cached
  blocks that prefixes its tokens (`find_cached`), always leaving at least its last token to compute so the step
  has logits to sample from;
* freed blocks keep their content until a fresh block is needed (BlockPool's LRU free queue).

Beam search gains the most: every step sends each beam as a new sequence whose prefix (prompt + the beam's earlier
tokens) is already cached, so a step computes at most one block's worth of tokens per beam instead of the prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenspout.core.block_hash import extend_block_hashes
from tokenspout.core.block_pool import BlockPool

if TYPE_CHECKING:
    from tokenspout.core.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative, in tokens: looked up when sequences entered the running set, and found cached."""

    queries: int = 0
    hits: int = 0


@dataclass(slots=True)
class BlockAsk:
    """One sequence's share of an allocation: grow `request_id` to hold `num_tokens` tokens, starting from the
    `cached` blocks (a hit found by find_cached; only for a sequence that holds no block yet)."""

    request_id: str
    num_tokens: int
    cached: Sequence[int] = ()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.pool = BlockPool(num_blocks)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks: dict[str, list[int]] = {}
        self._num_hashed: dict[str, int] = {}  # leading blocks of each sequence already recorded in the pool
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.num_blocks

    def blocks_of(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def blocks_needed(self, request_id: str, num_tokens_total: int) -> int:
        have = len(self._blocks.get(request_id, ()))
        return max(0, -(-num_tokens_total // self.block_size) - have)

    # ---- prefix cache ----------------------------------------------------------------------------------------
    def find_cached(self, req: Request) -> list[int]:
        """The cached blocks holding the longest block-aligned prefix of req's tokens, at most num_tokens - 1 of
        them (a sequence must compute its last token to sample).  Takes nothing: pass the result to allocate."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        extend_block_hashes(req.block_hashes, req.token_ids, max_blocks, self.block_size)
        hit: list[int] = []
        for h in req.block_hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        self.stats.queries += num_queried
        self.stats.hits += num_hit

    def cache_full_blocks(self, req: Request) -> None:
        """Records the blocks req has filled with computed tokens.  Call after each step's KV is written, with
        req.num_computed_tokens counting only final tokens (never drafts awaiting verification)."""
        if not self.enable_prefix_caching:
            return
        blocks = self._blocks.get(req.request_id)
        if not blocks:
            return
        n_full = min(req.num_computed_tokens // self.block_size, len(blocks))
        start = self._num_hashed.get(req.request_id, 0)
        if n_full <= start:
            return
        extend_block_hashes(req.block_hashes, req.token_ids, n_full, self.block_size)
        for i in range(start, n_full):
            self.pool.cache(blocks[i], req.block_hashes[i])
        self._num_hashed[req.request_id] = n_full

    # ---- allocation ------------------------------------------------------------------------------------------
    def allocate(self, request_id: str, num_tokens_total: int, cached: Sequence[int] = ()) -> list[int] | None:
        """Grows one sequence's blocks; returns the new fresh block ids, or None (nothing allocated) if the pool
        is too small."""
        have = len(self._blocks.get(request_id, ()))
        if not self.allocate_all([BlockAsk(request_id, num_tokens_total, cached)]):
            return None
        return self._blocks.get(request_id, [])[have + len(cached):]

    def allocate_all(self, asks: Sequence[BlockAsk]) -> bool:
        """All or nothing (a CFG pair grows together): False, with nothing allocated, when the free blocks cannot
        cover the fresh blocks plus the free cached blocks the hits take out of the free queue."""
        fresh = 0
        revived: set[int] = set()
        for a in asks:
            have = len(self._blocks.get(a.request_id, ()))
            if a.cached and have:
                raise RuntimeError(f"sequence {a.request_id} already holds blocks; cache hits start a sequence")
            fresh += max(0, -(-a.num_tokens // self.block_size) - have - len(a.cached))
            revived.update(b for b in a.cached if self.pool.is_free(b))
        if fresh + len(revived) > self.pool.num_free:
            return False
        # Every hit is taken before any fresh block, so a fresh block can never be the eviction of a hit.
        for a in asks:
            if a.cached:
                self.pool.touch(a.cached)
                self._blocks.setdefault(a.request_id, []).extend(a.cached)
                self._num_hashed[a.request_id] = len(a.cached)
        for a in asks:
            need = self.blocks_needed(a.request_id, a.num_tokens)
            if need:
                self._blocks.setdefault(a.request_id, []).extend(self.pool.take(need))
        return True

    def free(self, request_id: str) -> None:
        """Releases the sequence's blocks (finish, abort, preemption); cached ones stay findable until evicted."""
        blocks = self._blocks.pop(request_id, None)
        self._num_hashed.pop(request_id, None)
        if blocks:
            self.pool.release(blocks)
