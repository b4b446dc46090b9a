"""The chi-square goodness-of-fit check shared by the sampling-statistics tests."""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chisquare


def gof(observed: torch.Tensor, probs: np.ndarray) -> float:
    """Chi-square p-value of flat cell ids against probs; cells with expected count < 5 are pooled; a draw of a
    zero-probability cell gives 0."""
    counts = np.bincount(observed.numpy(), minlength=probs.size)
    if counts[probs == 0].sum():
        return 0.0
    expected = probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    # Rescale so the sums agree exactly (scipy rejects float drift between them).
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)
