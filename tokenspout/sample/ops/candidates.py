"""Candidate sets: the K largest logits of each row, without sorting the vocabulary.

`torch.topk(x, 128)` on [64, 128k] costs about twice an argmax on this CPU.  A two-stage top-k is
cheaper: view each row as s interleaved slabs [s, V/s], take the elementwise max across slabs (one
vectorised pass, like amax), top-k that pooled row of V/s columns, and top-k again among the s * K
tokens of the K winning columns.

Why this is exact (as a candidate set: every token left out is <= every token kept).  Let b be the
K-th largest column max.  The K winning columns each hold a token >= b, so the K largest gathered
values are all >= b; a token in a losing column is <= its column max <= b.  So nothing outside the
gathered set beats the K-th gathered value, and the second top-k returns a valid top-K (ties with the
K-th value may be split arbitrarily, which the coverage tests in topk_topp.py never rely on).
"""

from __future__ import annotations

import functools

import torch

POOL = 8  # slabs per row; 8 keeps the second top-k small (8 * K) while the pooled row is V / 8


def topk_values(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) of the k largest logits per row, values descending (ties in no particular order)."""
    rows, vocab = x.shape
    if k >= vocab:
        return x.sort(dim=-1, descending=True, stable=True)
    if vocab % POOL or 4 * POOL * k > vocab:
        return x.topk(k, -1)
    width = vocab // POOL
    pooled = x.view(rows, POOL, width).amax(1)
    cols = pooled.topk(k, -1).indices  # [R, k]
    ids = (_slab_starts(width, x.device) + cols.unsqueeze(1)).view(rows, POOL * k)
    vals, pick = x.gather(1, ids).topk(k, -1)
    return vals, ids.gather(1, pick)


@functools.lru_cache(maxsize=16)
def _slab_starts(width: int, device: torch.device) -> torch.Tensor:
    return (torch.arange(POOL, device=device) * width).view(1, POOL, 1)


def order_ties(y: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-sorts candidates (y descending) so that equal values are in ascending id order.

    Only needed when finite ties exist (common with bf16 logits): then one sort of an int64 key,
    the float's order-preserving bit pattern in the high word and the inverted id in the low word."""
    tied = (y[:, 1:] == y[:, :-1]) & (y[:, 1:] > float("-inf"))
    if not bool(tied.any()):
        return y, ids
    bits = y.contiguous().view(torch.int32).to(torch.int64)
    # Negative floats sort backwards as integers: flipping their 31 low bits restores the order.
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = bits * (1 << 32) + ((1 << 32) - 1 - ids)
    perm = key.sort(dim=-1, descending=True).indices
    return y.gather(1, perm), ids.gather(1, perm)


def candidates(x: torch.Tensor, k: int, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits of each row of x, scaled by 1 / temperature, sorted by (value desc, id asc)."""
    vals, ids = topk_values(x, k)
    y = vals / temperature.unsqueeze(-1)
    if k >= x.shape[1]:
        # A stable full sort already lists equal logits by id.  (Dividing by T can round two different
        # logits to one value; those keep logit order, a difference no distribution can see.)
        return y, ids
    return order_ties(y, ids)
