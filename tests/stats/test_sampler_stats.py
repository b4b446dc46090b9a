"""Distribution tests: every sampling path draws from exactly the target distribution.

For each path, one row is repeated N = 20,000 times in a batch with distinct seeds (or one seed at
distinct output positions), and a chi-square goodness-of-fit test against the exact target, computed
independently in float64 by full sort, must pass at alpha = 0.001 -- while a deliberately wrong target
must fail.  Seeds are fixed, so the tests are deterministic.  A block size of 4 over a 16-token vocabulary
makes the draw's two levels (block, then token within the block) both matter.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.stats.chi2 import gof
from tokenspout.sample.ops.topk_topp import TierConfig
from tokenspout.sample.sampler import Sampler
from tokenspout.sampling_params import SamplingParams
from tokenspout.worker.sampling_state import SamplingState

V = 16
N = 20_000
ALPHA = 1e-3
LOGITS = torch.tensor([2.1, 0.3, -1.0, 1.7, 0.9, -0.4, 1.2, 0.0, -2.0, 0.6, 1.9, -0.7, 0.2, 1.0, -1.5, 0.5])
PROMPT = [0, 3, 3, 7]
OUTPUT = [10, 10, 10, 4, 0]
BLOCKS = TierConfig(block_size=4)
FALLBACK = TierConfig(first_k=2, first_cap=2, later_k=(4,), block_size=4)  # forces the later tiers


def target(p: SamplingParams, penalised: bool = False) -> np.ndarray:
    """Exact processed distribution, float64, by definition (full sort, DESIGN order)."""
    y = LOGITS.double().clone()
    if penalised:
        for t in set(PROMPT + OUTPUT):
            y[t] = y[t] * p.repetition_penalty if y[t] < 0 else y[t] / p.repetition_penalty
        for t in set(OUTPUT):
            y[t] -= p.frequency_penalty * OUTPUT.count(t) + p.presence_penalty
    y = y / p.temperature
    ys, order = y.sort(descending=True, stable=True)
    w = (ys - ys[0]).exp()
    keep = torch.ones(V, dtype=torch.bool)
    if p.min_p:
        keep &= w >= p.min_p
    if p.top_k:
        keep &= ys >= ys[p.top_k - 1]
    if p.top_p < 1:
        wa = w * keep
        keep &= (wa.cumsum(0) - wa) < p.top_p * wa.sum()
    probs = torch.zeros(V, dtype=torch.float64)
    probs[order[keep]] = w[keep] / w[keep].sum()
    return probs.numpy()


def draws(rows: list[SamplingParams], tiers: TierConfig = BLOCKS, *, one_seed: bool = False,
          penalised: bool = False, kernel: bool = True) -> torch.Tensor:
    state = SamplingState(len(rows), V, torch.device("cpu"))
    out = OUTPUT if penalised else []
    for i, p in enumerate(rows):
        # one_seed: a single request seen at N different output positions (the hash's position axis).
        state.add_request(i, p, PROMPT, out + [1] * (i if one_seed else 0), 12345 if one_seed else 1_000_003 * i)
    logits = LOGITS.expand(len(rows), V).contiguous()
    if one_seed and penalised:
        raise ValueError("the extra output would change the penalties")
    return Sampler(tiers, cpu_kernel=kernel)(logits, state.metadata(list(range(len(rows))))).sampled_token_ids


CASES = {
    "temperature": (SamplingParams(temperature=0.7), SamplingParams(temperature=0.8)),
    "top_k": (SamplingParams(top_k=5), SamplingParams(top_k=6)),
    "top_p": (SamplingParams(top_p=0.8), SamplingParams(top_p=0.9)),
    "min_p": (SamplingParams(min_p=0.1, temperature=1.3), SamplingParams(min_p=0.05, temperature=1.3)),
    "top_k_top_p": (SamplingParams(top_k=8, top_p=0.9, temperature=0.9), SamplingParams(top_k=8, temperature=0.9)),
    "all_knobs": (SamplingParams(top_k=10, top_p=0.95, min_p=0.3, temperature=1.5),
                  SamplingParams(top_k=10, top_p=0.95, temperature=1.5)),
}


# Random rows take the CPU kernel (ops/rows_cpu.py) when it loads; the torch paths are tested with it off.
PATHS = {"blocks": (BLOCKS, False), "fallback-tiers": (FALLBACK, False), "cpu-kernel": (BLOCKS, True)}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", list(CASES))
def test_path_matches_target(case: str, path: str) -> None:
    p, wrong = CASES[case]
    tiers, kernel = PATHS[path]
    if kernel and Sampler()._lib is None:
        pytest.skip("the kernel does not build here")
    ids = draws([p] * N, tiers, kernel=kernel)
    assert gof(ids, target(p)) > ALPHA
    assert gof(ids, target(wrong)) < ALPHA


def test_penalties() -> None:
    p = SamplingParams(repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.3, top_p=0.97)
    ids = draws([p] * N, penalised=True)
    assert gof(ids, target(p, penalised=True)) > ALPHA
    assert gof(ids, target(p, penalised=False)) < ALPHA


def test_mixed_greedy_random_batch() -> None:
    greedy, rand = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9)
    ids = draws([greedy, rand] * N)
    assert bool((ids[0::2] == int(LOGITS.argmax())).all())
    assert gof(ids[1::2], target(rand)) > ALPHA
    assert gof(ids[1::2], target(SamplingParams(temperature=0.8))) < ALPHA


@pytest.mark.parametrize("p", [SamplingParams(temperature=1.1), SamplingParams(top_p=0.85),
                               SamplingParams(top_k=9, top_p=0.9)], ids=["dense", "sparse", "top-k"])
@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "cpu-kernel"])
def test_hash_noise_along_positions(p: SamplingParams, kernel: bool) -> None:
    """One seed, N consecutive output positions: the counter-based noise must be independent across
    positions, not just across seeds."""
    ids = draws([p] * N, one_seed=True, kernel=kernel)
    assert gof(ids, target(p)) > ALPHA
    assert gof(ids, target(SamplingParams(temperature=p.temperature * 1.15, top_p=p.top_p, top_k=p.top_k))) < ALPHA
