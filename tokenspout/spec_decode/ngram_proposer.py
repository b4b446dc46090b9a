"""Prompt-lookup (n-gram) drafts: if the sequence's last n tokens occurred before, propose what followed.

For n from ngram_max down to ngram_min, the suffix n-gram of prompt + output is looked up among the
earlier positions; the first n with a match wins (longest context first), and among its matches the most
recent one (the nearest context is the best predictor of what comes next).  The proposal is up to k
tokens that followed that occurrence, fewer where the sequence ends first.

Search: one vectorised comparison of the whole sequence against its last token gives the candidate end
positions; each further step keeps the candidates whose token d places back also matches the suffix.
Candidates thin out geometrically, so the cost is ~ one numpy pass over the sequence plus a handful of
small fancy-indexing steps -- no Python loop over positions, and no KMP table to build per call.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

logger = logging.getLogger(__name__)


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, ngram_min: int, ngram_max: int) -> None:
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        if ngram_min < 1:
            raise ValueError(f"ngram_min must be >= 1, got {ngram_min}")
        if ngram_max < ngram_min:
            raise ValueError(f"ngram_max must be >= ngram_min ({ngram_min}), got {ngram_max}")
        self.k = num_speculative_tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, token_ids: Sequence[int] | np.ndarray) -> list[int]:
        """Up to k draft tokens for the sequence (prompt + output so far); [] if no suffix n-gram recurs.

        Pass a numpy array where you keep one: converting a long Python list dominates the cost."""
        if isinstance(token_ids, np.ndarray):
            seq = token_ids
        else:  # fromiter with a known count is the quickest list -> array conversion (~1.5x asarray)
            seq = np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))
        start = self.match(seq)
        if start < 0:
            return []
        return seq[start : start + self.k].tolist()

    def match(self, seq: np.ndarray) -> int:
        """Index of the first proposed token in seq (just after the chosen earlier occurrence), or -1."""
        n_tok = seq.shape[0]
        if self.k == 0 or n_tok <= self.ngram_min:
            return -1
        # ends: end positions e (inclusive) of earlier occurrences; e <= n_tok - 2 so a token follows.
        ends = np.flatnonzero(seq[: n_tok - 1] == seq[n_tok - 1])
        best = -1
        length = 1
        while ends.size:
            if length >= self.ngram_min:
                best = int(ends[-1])  # most recent occurrence of the longest suffix matched so far
            if length == self.ngram_max or length == n_tok - 1:
                break
            # Extend the match one token back: e - length must exist and equal the suffix's token.
            ends = ends[ends >= length]
            ends = ends[seq[ends - length] == seq[n_tok - 1 - length]]
            length += 1
        return best + 1 if best >= 0 else -1

    def propose_batch(self, sequences: Sequence[Sequence[int] | np.ndarray]) -> list[list[int]]:
        """propose() for each sequence (each is independent; the per-sequence work is already vectorised)."""
        return [self.propose(s) for s in sequences]
