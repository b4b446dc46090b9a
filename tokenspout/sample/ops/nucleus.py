"""Top-p for rows whose nucleus is too wide for any candidate set, without sorting the vocabulary.

A flat distribution (high temperature, or an uncertain step) can keep most of a 128k vocabulary under
top_p = 0.9; sorting such a row costs ~12 ms here.  Instead, bucket the probabilities by the top bits of
their float32 pattern -- for p >= 0 the bit pattern is monotone in p, so `bits >> 17` (exponent and 6
mantissa bits, buckets ~1% wide at 128k tokens; coarser for smaller vocabularies) orders buckets exactly
as it orders probabilities -- and add the mass of each bucket.  Walking the buckets from the top finds
the boundary bucket b*:
- every token in a higher bucket has less than `top_p * Z` ahead of it (all its predecessors are in
  buckets above b*, whose total is below the target): kept;
- every token in a lower bucket has at least the mass of buckets >= b* ahead of it, >= the target: dropped;
- only the boundary bucket's few tokens need ordering: they are sorted (value desc, id asc) and cut
  exactly as topk_topp.py cuts candidates.
The result is the same kept set as a full sort (tests/unit/test_sampler_truncation.py), drawn densely.
"""

from __future__ import annotations

import torch

from tokenspout.sample.ops.candidates import order_ties
from tokenspout.sample.ops.draw import DEFAULT_BLOCK_SIZE, block_mass
from tokenspout.sample.ops.knobs import RowKnobs

ONE_BITS = 0x3F800000  # bit pattern of 1.0, the largest probability
NEG_INF = float("-inf")


def bucket_shift(vocab: int) -> int:
    """Bits dropped from the float pattern: at most ~V/8 buckets (17 bits, 8k buckets at 128k tokens),
    so the bucket table stays small next to the row (any width is exact; narrower buckets just leave
    fewer tokens to sort at the boundary)."""
    shift = 16
    while shift < 24 and (ONE_BITS >> shift) + 1 > max(64, vocab // 8):
        shift += 1
    return shift


def wide_top_p(x: torch.Tensor, kn: RowKnobs) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [R, V] with top_p < 1 (and maybe min_p), no top-k.  Returns (scaled logits with -inf where
    dropped, probabilities with 0 where dropped), both [R, V]."""
    rows, vocab = x.shape
    shift = bucket_shift(vocab)
    num_buckets = (ONE_BITS >> shift) + 1
    y = x / kn.temperature.unsqueeze(-1)
    p = y.softmax(-1)
    if kn.any_min_p:
        p.masked_fill_(p < kn.min_p.unsqueeze(-1) * p.amax(-1, keepdim=True), 0.0)
    # Z_A by block sums (batch-invariant, see draw.block_mass); p sums to ~1 before min_p.
    target = kn.top_p * block_mass(p, DEFAULT_BLOCK_SIZE).sum(-1)
    key = (p.view(torch.int32) >> shift).to(torch.int64)
    mass = torch.zeros(rows, num_buckets, dtype=p.dtype, device=p.device).scatter_add_(1, key, p)
    desc = mass.flip(-1).cumsum(-1)  # desc[j]: mass of buckets num_buckets-1-j and above
    j = (desc < target.unsqueeze(-1)).sum(-1, keepdim=True).clamp_(max=num_buckets - 1)
    boundary = num_buckets - 1 - j  # [R, 1]
    above = torch.where(j > 0, desc.gather(1, (j - 1).clamp(min=0)), 0.0).squeeze(-1)
    inside = key == boundary
    width = int(torch.count_nonzero(inside, dim=-1).max())
    vals, ids = torch.where(inside, y, NEG_INF).topk(width, -1)
    vals, ids = order_ties(vals, ids)
    w = p.gather(1, ids).masked_fill_(vals == NEG_INF, 0.0)
    ahead = above.unsqueeze(-1) + w.cumsum(-1) - w
    keep = key > boundary  # zero-probability tokens sit in bucket 0, below any boundary that matters
    cut = (ahead < target.unsqueeze(-1)) & (w > 0)
    # Rows with fewer boundary tokens than `width` have -inf padding in vals: leave those ids alone.
    keep.scatter_(1, ids, torch.where(vals > NEG_INF, cut, keep.gather(1, ids)))
    return y.masked_fill_(~keep, NEG_INF), p.masked_fill_(~keep, 0.0)
