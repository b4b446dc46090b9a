"""compute_processed_logits against transformers' logits processors, one row at a time.

Order: our sampler (DESIGN invariant 2, like vLLM) applies repetition penalty, temperature, min_p, top-k,
top-p.  HF's generate() builds its warpers as temperature, top-k, top-p, min_p: min_p last.  min_p and
top-k are both "value >= threshold" masks (min_p's threshold p_max * min_p is unchanged by top-k, which
always keeps the max), so they commute; min_p and top-p do not (top-p after min_p works on the
renormalised min_p survivors and keeps fewer tokens).  The oracle is therefore HF's own processors in
our order: RepetitionPenalty -> Temperature -> MinP -> TopK -> TopP; `test_hf_generate_order_differs`
documents the difference with HF's generate() order.  Both apply min_p after temperature.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tokenspout.sample.ops.topk_topp import TierConfig
from tokenspout.sample.sampler import compute_processed_logits
from tokenspout.sampling_params import SamplingParams
from tokenspout.worker.sampling_state import build_metadata

SMALL_TIERS = TierConfig(first_k=4, first_cap=8, later_k=(16,), block_size=8)


def hf_probs(logits: torch.Tensor, p: SamplingParams, input_ids: list[int], min_p_last: bool = False) -> torch.Tensor:
    scores = logits.unsqueeze(0).clone()
    ids = torch.tensor([input_ids or [0]])
    if p.repetition_penalty != 1.0 and input_ids:
        scores = RepetitionPenaltyLogitsProcessor(float(p.repetition_penalty))(ids, scores)
    scores = TemperatureLogitsWarper(float(p.temperature))(ids, scores)
    warpers = []
    if p.min_p > 0 and not min_p_last:
        warpers.append(MinPLogitsWarper(p.min_p))
    if p.top_k > 0:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        warpers.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0 and min_p_last:
        warpers.append(MinPLogitsWarper(p.min_p))
    for w in warpers:
        scores = w(ids, scores)
    return scores.softmax(-1)[0]


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.3, 0.7, 1.0, 1.6]),
        top_k=rng.choice([0, 0, 1, 3, 10, 40, vocab + 7]),
        top_p=rng.choice([1.0, 1.0, 0.95, 0.8, 0.5, 0.2]),
        min_p=rng.choice([0.0, 0.0, 0.02, 0.1, 0.4]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
    )


@pytest.mark.parametrize("tiers", [None, SMALL_TIERS], ids=["default-tiers", "small-tiers"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_processed_matches_hf(seed: int, tiers: TierConfig | None) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    vocab, rows = 64, 48
    params = [random_params(rng, vocab) for _ in range(rows)]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 6))] for _ in range(rows)]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 6))] for _ in range(rows)]
    # Scales from flat to peaked, so top-p sets range from 1 token to most of the vocabulary.
    logits = torch.randn(rows, vocab) * torch.tensor([rng.choice([0.5, 2.0, 5.0]) for _ in range(rows)])[:, None]
    meta = build_metadata(params, vocab, prompts=prompts, outputs=outputs)
    ours = compute_processed_logits(logits, meta, tiers).softmax(-1)
    for r in range(rows):
        ref = hf_probs(logits[r], params[r], prompts[r] + outputs[r])
        torch.testing.assert_close(ours[r], ref, atol=1e-5, rtol=0, msg=f"row {r}: {params[r]}")


def test_topk_ties_match_hf() -> None:
    """HF keeps every token >= the k-th value: ties at the boundary all stay, even beyond k."""
    vocab = 32
    base = torch.linspace(-3, 0, vocab)
    logits = torch.stack([base.clone() for _ in range(4)])
    logits[:, [3, 9, 17, 30]] = 1.0  # four tokens tied at the 3rd..6th place
    logits[:, 5] = 2.0
    logits[:, 6] = 1.5
    params = [SamplingParams(top_k=k) for k in (2, 3, 4, 6)]
    for tiers in (None, TierConfig(first_k=3, first_cap=4, later_k=(5,), block_size=4)):
        ours = compute_processed_logits(logits, build_metadata(params, vocab), tiers).softmax(-1)
        for r, p in enumerate(params):
            torch.testing.assert_close(ours[r], hf_probs(logits[r], p, []), atol=1e-6, rtol=0)
    assert int((ours[1] > 0).sum()) == 6  # k=3 keeps 2.0, 1.5 and all four 1.0s


@pytest.mark.parametrize("tiers", [None, TierConfig(first_k=2, first_cap=4, later_k=(4,), block_size=4)])
def test_topp_ties_match_hf(tiers: TierConfig | None) -> None:
    """Ties straddling the top-p boundary: HF keeps exactly enough tied tokens to cross top_p; which of
    the equal tokens it keeps follows torch.sort's unstable order, so compare the kept probabilities as
    a multiset, and every untied token exactly.  (We keep the lowest ids among ties.)"""
    vocab = 24
    probs = torch.full((vocab,), 0.1 / (vocab - 5))
    probs[[2, 7, 11, 19]] = 0.2  # four tied tokens
    probs[4] = 0.1
    logits = probs.log()
    params = [SamplingParams(top_p=p) for p in (0.15, 0.3, 0.5, 0.65, 0.75, 0.85, 0.95)]
    rows = logits.expand(len(params), vocab).contiguous()
    ours = compute_processed_logits(rows, build_metadata(params, vocab), tiers).softmax(-1)
    for r, p in enumerate(params):
        ref = hf_probs(logits, p, [])
        torch.testing.assert_close(ours[r].sort().values, ref.sort().values, atol=1e-6, rtol=0)
        untied = (logits[:, None] == logits[None, :]).sum(-1) == 1
        torch.testing.assert_close(ours[r][untied], ref[untied], atol=1e-6, rtol=0)
    # 0.5: 0.2 + 0.2 = 0.4 < 0.5, the third tied token crosses it: three of the four tied tokens stay.
    assert ours[2][[2, 7, 11, 19]].gt(0).tolist() == [True, True, True, False]


def test_hf_generate_order_differs() -> None:
    """Documents the one order difference: with min_p and top_p both set, HF's generate() (min_p after
    top-p) can keep more tokens than our (and vLLM's) min_p-before-top-p order."""
    probs = torch.tensor([0.4, 0.3, 0.2, 0.05, 0.05])
    p = SamplingParams(top_p=0.75, min_p=0.2)
    ours = compute_processed_logits(probs.log()[None], build_metadata([p], 5)).softmax(-1)[0]
    torch.testing.assert_close(ours, hf_probs(probs.log(), p, []), atol=1e-6, rtol=0)
    generate_order = hf_probs(probs.log(), p, [], min_p_last=True)
    assert int((ours > 0).sum()) == 2 and int((generate_order > 0).sum()) == 3
