"""N-gram (prompt-lookup) proposer: constructed sequences against a brute-force reference, and its cost."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from tokenspout.spec_decode import NgramProposer


def reference(seq: list[int], k: int, lo: int, hi: int) -> list[int]:
    """By definition: longest suffix n-gram (hi down to lo) with an earlier occurrence, its most recent one."""
    n_tok = len(seq)
    for n in range(hi, lo - 1, -1):
        if n >= n_tok:
            continue
        suffix = seq[n_tok - n :]
        for start in range(n_tok - n - 1, -1, -1):  # occurrences that end before the last token
            if seq[start : start + n] == suffix:
                return seq[start + n : start + n + k]
    return []


def test_repeat_proposes_what_followed():
    p = NgramProposer(3, 1, 3)
    assert p.propose([1, 2, 3, 4, 5, 9, 1, 2, 3]) == [4, 5, 9]
    assert p.propose(np.array([1, 2, 3, 4, 5, 9, 1, 2, 3])) == [4, 5, 9]


def test_no_match_gives_nothing():
    p = NgramProposer(4, 1, 3)
    assert p.propose([1, 2, 3, 4, 5]) == []
    assert p.propose([]) == [] and p.propose([7]) == []


def test_longest_ngram_wins_over_a_more_recent_shorter_one():
    # Suffix [8, 9]: the bigram occurs at 0 (followed by 1); the unigram 9 occurs later at 4 (followed by 5).
    seq = [8, 9, 1, 0, 9, 5, 8, 9]
    assert NgramProposer(1, 1, 2).propose(seq) == [1]
    assert NgramProposer(1, 1, 1).propose(seq) == [5]  # ngram_max 1: only unigrams, most recent


def test_most_recent_occurrence_wins():
    seq = [5, 6, 1, 5, 6, 2, 5, 6]
    assert NgramProposer(1, 2, 2).propose(seq) == [2]


def test_ngram_min_rejects_shorter_matches():
    seq = [3, 7, 1, 2, 7]  # only the unigram 7 recurs
    assert NgramProposer(2, 1, 3).propose(seq) == [1, 2]
    assert NgramProposer(2, 2, 3).propose(seq) == []


def test_ngram_max_caps_the_match_length():
    # Suffix [1, 2, 3] occurs at 0 (then 4); [2, 3] alone occurs more recently at 5 (then 6).
    seq = [1, 2, 3, 4, 0, 2, 3, 6, 1, 2, 3]
    assert NgramProposer(1, 1, 3).propose(seq) == [4]
    assert NgramProposer(1, 1, 2).propose(seq) == [6]


def test_overlapping_matches_and_truncation_at_the_end():
    # Period-2 sequence: [1, 2] last occurred at 2..3 (overlapping the suffix's neighbourhood); only two
    # tokens follow it before the end, so k = 5 is truncated to 2.
    assert NgramProposer(5, 2, 2).propose([1, 2, 1, 2, 1, 2]) == [1, 2]
    # A run of one token: the most recent earlier [7, 7, 7] ends one before the end, leaving one token.
    assert NgramProposer(3, 3, 3).propose([7, 7, 7, 7, 7]) == [7]
    assert NgramProposer(3, 1, 4).propose([7, 7]) == [7]


def test_match_at_the_very_end_of_the_earlier_context():
    # The earlier occurrence ends right before the suffix starts: the proposal is the suffix itself.
    assert NgramProposer(2, 2, 2).propose([4, 5, 4, 5]) == [4, 5]
    assert NgramProposer(3, 1, 1).propose([9, 1, 9]) == [1, 9]


def test_k_zero_and_validation():
    assert NgramProposer(0, 1, 3).propose([1, 1, 1]) == []
    with pytest.raises(ValueError, match="ngram_min"):
        NgramProposer(3, 0, 2)
    with pytest.raises(ValueError, match="ngram_max"):
        NgramProposer(3, 3, 2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(-1, 1, 2)


@pytest.mark.parametrize("alphabet", [2, 3, 8])
def test_matches_brute_force_reference(alphabet: int):
    rng = random.Random(alphabet)
    for _ in range(300):
        seq = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 40))]
        lo = rng.randint(1, 4)
        hi = rng.randint(lo, 6)
        k = rng.randint(1, 6)
        got = NgramProposer(k, lo, hi).propose(seq)
        assert got == reference(seq, k, lo, hi), (seq, k, lo, hi)


def test_propose_batch():
    p = NgramProposer(2, 1, 2)
    seqs = [[1, 2, 1], [3, 4], np.array([5, 6, 7, 5, 6])]
    assert p.propose_batch(seqs) == [[2, 1], [], [7, 5]]


def test_cost_is_microseconds_on_long_contexts():
    """Loose bound (shared CPU): an 8k-token ndarray with many repeats proposes in well under a millisecond."""
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 50, 8192)  # low-entropy text: thousands of candidate positions for the last token
    p = NgramProposer(5, 2, 5)
    p.propose(seq)
    best = min(_timed(p, seq) for _ in range(5))
    assert best < 1e-3, f"{best * 1e6:.0f} us per proposal"


def _timed(p: NgramProposer, seq: np.ndarray, reps: int = 50) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        p.propose(seq)
    return (time.perf_counter() - t0) / reps
