"""Distribution tests for the further warpers (sample/ops/warpers.py): the sampler's draws against an independent
float64 target, chi-square at alpha = 0.001, and a deliberately different target must fail (as test_sampler_stats).

Targets: transformers' TypicalLogitsWarper / EpsilonLogitsWarper / EtaLogitsWarper chained after its Temperature /
MinP / TopK / TopP warpers (our order); top_n_sigma and dynatemp from llama.cpp's algorithms written out in
tests/unit/test_sampler_warpers.py (dynatemp's entropy over the top-k candidates on a row with top-k); XTC as the
mixture (1 - q) * P + q * P_xtc of llama.cpp's rule, since the coin comes up with probability q per step -- and its
drop rate (how often the top token disappears) checked on its own.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import binomtest

from tests.stats.chi2 import gof
from tests.stats.test_sampler_stats import BLOCKS, FALLBACK, LOGITS, N, draws
from tests.unit.test_sampler_warpers import hf_scores, ref_dynatemp, ref_top_n_sigma, ref_xtc
from tokenspout.sampling_params import SamplingParams

ALPHA = 1e-3


def target(p: SamplingParams) -> np.ndarray:
    x = LOGITS.double()
    if p.top_n_sigma > 0:
        x = torch.tensor(ref_top_n_sigma(x.tolist(), p.top_n_sigma), dtype=torch.float64)
    t = p.temperature
    if p.dynatemp_range > 0:  # the entropy of the top-k candidates on a row with top-k (ties at the k-th value stay)
        kth = sorted(x.tolist(), reverse=True)[p.top_k - 1] if 0 < p.top_k <= x.numel() else -float("inf")
        t = ref_dynatemp([v if v >= kth else -float("inf") for v in x.tolist()], p.temperature, p.dynatemp_range,
                         p.dynatemp_exponent)
    # hf_scores applies temperature, min_p, top-k, top-p, typical, epsilon, eta (the logits are float64 throughout)
    plain = SamplingParams(temperature=t, min_p=p.min_p, top_k=p.top_k, top_p=p.top_p, typical_p=p.typical_p,
                           epsilon_cutoff=p.epsilon_cutoff, eta_cutoff=p.eta_cutoff)
    scores = hf_scores(x, plain)
    probs = scores.softmax(-1).numpy()
    if p.xtc_probability > 0 and p.xtc_threshold <= 0.5:
        dropped = torch.tensor(ref_xtc(scores.tolist(), p.xtc_threshold), dtype=torch.float64).softmax(-1).numpy()
        probs = (1 - p.xtc_probability) * probs + p.xtc_probability * dropped
    return probs


CASES = {
    "typical": (SamplingParams(typical_p=0.6), SamplingParams(typical_p=0.8)),
    "typical+top_k+T": (SamplingParams(typical_p=0.7, top_k=8, temperature=1.3), SamplingParams(top_k=8,
                                                                                                 temperature=1.3)),
    "epsilon+top_p": (SamplingParams(epsilon_cutoff=0.04, top_p=0.95), SamplingParams(top_p=0.95)),
    "eta+min_p": (SamplingParams(eta_cutoff=0.05, min_p=0.02, temperature=1.5),
                  SamplingParams(min_p=0.02, temperature=1.5)),
    "top_n_sigma": (SamplingParams(top_n_sigma=1.0, temperature=1.5), SamplingParams(top_n_sigma=1.3,
                                                                                     temperature=1.5)),
    "xtc": (SamplingParams(xtc_probability=0.5, xtc_threshold=0.1), SamplingParams(xtc_probability=0.3,
                                                                                   xtc_threshold=0.1)),
    "xtc+top_k": (SamplingParams(xtc_probability=1.0, xtc_threshold=0.12, top_k=6),
                  SamplingParams(xtc_probability=1.0, xtc_threshold=0.2, top_k=6)),
    "dynatemp": (SamplingParams(dynatemp_range=0.6, dynatemp_exponent=1.0),
                 SamplingParams(dynatemp_range=0.6, dynatemp_exponent=3.0)),
    "all": (SamplingParams(top_n_sigma=2.0, dynatemp_range=0.3, top_k=12, top_p=0.97, typical_p=0.9,
                           epsilon_cutoff=0.01, eta_cutoff=0.01, xtc_probability=0.4, xtc_threshold=0.1),
            SamplingParams(top_n_sigma=2.0, dynatemp_range=0.3, top_k=12, top_p=0.97, typical_p=0.9,
                           epsilon_cutoff=0.01, eta_cutoff=0.01)),
}


PATHS = [(case, "blocks") for case in CASES] + [(c, "fallback-tiers") for c in ("typical+top_k+T", "xtc+top_k", "all")]


@pytest.mark.parametrize(("case", "path"), PATHS)
def test_warper_matches_target(case: str, path: str) -> None:
    p, wrong = CASES[case]
    # The warped rows share the batch with greedy and plain rows (which take the kernel where it loads).
    rows = ([p] * 8 + [SamplingParams(temperature=0.0), SamplingParams(top_p=0.9)]) * (N // 8)
    ids = draws(rows, BLOCKS if path == "blocks" else FALLBACK)
    ids = ids.view(-1, 10)[:, :8].reshape(-1)
    assert gof(ids, target(p)) > ALPHA
    assert gof(ids, target(wrong)) < ALPHA


def test_seeded_positions_xtc() -> None:
    """One seed over N output positions: the XTC coin and the draw both independent along positions."""
    p = SamplingParams(xtc_probability=0.5, xtc_threshold=0.1, top_p=0.98)
    ids = draws([p] * N, one_seed=True)
    assert gof(ids, target(p)) > ALPHA
    assert gof(ids, target(SamplingParams(top_p=0.98))) < ALPHA


@pytest.mark.parametrize("q", [0.2, 0.7])
def test_xtc_drop_rate(q: float) -> None:
    """The top token can only be drawn on steps where the coin did not come up: its frequency is (1 - q) * p_top."""
    p = SamplingParams(xtc_probability=q, xtc_threshold=0.1)
    ids = draws([p] * N)
    top = int(LOGITS.argmax())
    p_top = float(LOGITS.double().softmax(-1)[top])
    hits = int((ids == top).sum())
    assert binomtest(hits, N, (1 - q) * p_top).pvalue > ALPHA
    assert binomtest(hits, N, (1 - q - 0.05) * p_top).pvalue < ALPHA
