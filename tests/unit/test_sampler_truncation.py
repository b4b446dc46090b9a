"""The candidate-set truncation is exact: it keeps exactly the tokens a full sort would keep.

The reference sorts every row fully (stable: ties in id order) and applies min_p, top-k and top-p by
their definitions.  Small tier sizes force every path: first candidate set, second, full sort, dense.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from tokenspout.sample.ops.candidates import topk_values
from tokenspout.sample.ops.topk_topp import TierConfig, materialize, truncate
from tokenspout.sampling_params import SamplingParams
from tokenspout.worker.sampling_state import build_metadata

NEG_INF = float("-inf")


def reference(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Processed logits of one row by full sort."""
    vocab = x.shape[0]
    y = x / p.temperature
    ys, order = y.sort(descending=True, stable=True)
    w = (ys - ys[0]).exp()
    keep = w > 0
    if p.min_p > 0:
        keep &= w >= p.min_p
    if 0 < p.top_k < vocab:
        keep &= ys >= ys[p.top_k - 1]
    if p.top_p < 1:
        wa = w * keep
        keep &= (wa.cumsum(0) - wa) < p.top_p * wa.sum()
    out = torch.full_like(y, NEG_INF)
    out[order[keep]] = ys[keep]
    return out


def make_rows(rng: random.Random, rows: int, vocab: int, bf16: bool) -> tuple[torch.Tensor, list[SamplingParams]]:
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    scale = torch.tensor([rng.choice([0.3, 1.0, 3.0, 8.0]) for _ in range(rows)])[:, None]
    x = torch.randn(rows, vocab, generator=gen) * scale
    if bf16:  # bf16 logits cast up: ties everywhere
        x = x.bfloat16().float()
    params = [
        SamplingParams(
            temperature=rng.choice([0.5, 1.0, 1.5]),
            top_k=rng.choice([0, 0, 1, 7, 20, 100, 300]),
            top_p=rng.choice([1.0, 0.99, 0.9, 0.6, 0.2]),
            min_p=rng.choice([0.0, 0.0, 0.001, 0.05, 0.3]),
        )
        for _ in range(rows)
    ]
    return x, params


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-ties"])
@pytest.mark.parametrize(
    "tiers", [TierConfig(), TierConfig(first_k=8, first_cap=16, later_k=(64,), block_size=64)], ids=["default", "small"]
)
def test_truncation_equals_full_sort(tiers: TierConfig, bf16: bool) -> None:
    rng = random.Random(7 + bf16)
    vocab, rows = 4096, 96
    x, params = make_rows(rng, rows, vocab, bf16)
    meta = build_metadata(params, vocab)
    kept = truncate(x, meta, tiers)
    got = materialize(x, kept)
    for r in range(rows):
        ref = reference(x[r], params[r])
        assert torch.equal(got[r] > NEG_INF, ref > NEG_INF), f"row {r} {params[r]}"
        torch.testing.assert_close(got[r], ref, rtol=0, atol=0)
    used = Counter(part.k for part in kept.sparse for _ in range(part.rows.numel()))
    for part in kept.dense:
        used["nucleus" if part.wide_top_p else "dense"] += part.rows.numel()
    if tiers.first_k == 8:  # the small tiers must have exercised every path: first (<= 16), 64, V, dense
        assert {64, vocab, "dense", "nucleus"} <= set(used), used
        assert min(k for k in used if isinstance(k, int)) <= 16, used


def test_pooled_topk_equals_topk() -> None:
    gen = torch.Generator().manual_seed(0)
    for vocab, k in ((4096, 16), (49_152, 128), (128_256, 50)):
        x = torch.randn(8, vocab, generator=gen)
        vals, ids = topk_values(x, k)
        ref_vals, _ = x.topk(k, -1)
        assert torch.equal(vals, ref_vals)
        assert torch.equal(x.gather(1, ids), vals)
        assert bool((ids.sort(-1).values.diff(dim=-1) > 0).all())  # distinct ids


def test_pooled_topk_is_a_valid_candidate_set_with_ties() -> None:
    """With heavy ties the split of tied values may differ from topk, but every token left out is <=
    every candidate."""
    x = torch.randint(0, 6, (16, 4096)).float()
    vals, ids = topk_values(x, 64)
    left_out = torch.ones_like(x, dtype=torch.bool).scatter_(1, ids, False)
    assert bool((x.masked_fill(~left_out, NEG_INF).amax(-1) <= vals[:, -1]).all())


def test_wide_nucleus_without_sort_equals_full_sort() -> None:
    """Flat rows at a real vocabulary size: the top-p set holds tens of thousands of tokens, far past
    every candidate set, and is found by probability buckets instead of a sort."""
    vocab = 49_152
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, vocab, generator=gen)
    x[5] = x[5].bfloat16().float()  # heavy ties inside the boundary bucket
    params = [SamplingParams(top_p=p, temperature=t, min_p=m)
              for p, t, m in ((0.5, 1.0, 0.0), (0.9, 1.0, 0.0), (0.99, 0.7, 0.0), (0.9, 1.5, 0.05),
                              (0.95, 1.0, 0.3), (0.9, 1.0, 0.0))]
    kept = truncate(x, build_metadata(params, vocab), TierConfig())
    wide = [part.rows.tolist() for part in kept.dense if part.wide_top_p]
    assert wide == [[1, 2, 3, 5]], kept  # row 0's nucleus fits 8192 candidates, row 4's min_p set is small
    got = materialize(x, kept)
    for r, p in enumerate(params):
        ref = reference(x[r], p)
        assert torch.equal(got[r] > NEG_INF, ref > NEG_INF), f"row {r} {p}"
        torch.testing.assert_close(got[r], ref, rtol=0, atol=0)
        assert r not in wide[0] or int((ref > NEG_INF).sum()) > 8192
