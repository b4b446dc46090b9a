"""Content hashes of full KV blocks (automatic prefix caching).

A full block's KV is a pure function of the model and of every token id up to the block's end (the positions
follow from the token count), so a block is identified by the chain hash(parent block's hash, this block's token
ids): equal hashes mean equal token prefixes, hence equal KV.  Nothing else changes the KV in this engine: one
engine serves one model in one dtype, and grammars, sampling knobs and classifier-free guidance act on logits only
(a CFG companion is an ordinary sequence of tokens; its blocks are shared with any sequence holding the same
tokens).  A feature that did change the KV for the same tokens (adapters, images) would fold its identity into
the first block's parent.

SHA-256 rather than Python's hash(): a collision would silently hand one request another's KV, and the hashes of
int tuples are predictable enough to collide on purpose (vLLM moved its prefix cache to SHA-256 for that reason);
at about a microsecond per 16-token block the cost is noise.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes

ROOT: BlockHash = b"tokenspout-kv-prefix-v1"  # the parent of every sequence's first block


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], num_blocks: int, block_size: int) -> None:
    """Grows `hashes` (the chain of one sequence, kept across steps) to cover its first `num_blocks` full blocks.
    The tokens of those blocks must be final: a sequence's hashes are never recomputed."""
    if num_blocks * block_size > len(token_ids):
        raise ValueError(f"{num_blocks} blocks of {block_size} tokens exceed the sequence's {len(token_ids)} tokens")
    parent = hashes[-1] if hashes else ROOT
    for i in range(len(hashes), num_blocks):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
