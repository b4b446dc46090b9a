"""no_repeat_ngram_size against transformers' NoRepeatNGramLogitsProcessor, and DRY against a plain O(N^2) reference
written from llama.cpp's llama_sampler_dry_apply (steps 1-4 of its comments), on crafted repetitive contexts.  Both
are checked built from a whole history at once (a new or preempted request) and grown token by token (decode)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

from tokenspout.sample.ops.repeats import DryState, NgramBans
from tokenspout.sample.sampler import compute_processed_logits
from tokenspout.sampling_params import SamplingParams
from tokenspout.worker.sampling_state import SamplingState

V = 12


def hf_ngram_banned(tokens: list[int], n: int) -> set[int]:
    scores = torch.zeros(1, V)
    out = NoRepeatNGramLogitsProcessor(n)(torch.tensor([tokens]), scores)
    return set(torch.isinf(out[0]).nonzero().flatten().tolist())


def repetitive(rng: random.Random, length: int, alphabet: int = 4) -> list[int]:
    """Text that repeats itself: copies of earlier stretches mixed with fresh tokens."""
    out: list[int] = []
    while len(out) < length:
        if len(out) > 4 and rng.random() < 0.6:
            a = rng.randrange(len(out) - 2)
            out += out[a:a + rng.randrange(2, 8)]
        else:
            out.append(rng.randrange(alphabet))
    return out[:length]


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_no_repeat_ngram_matches_transformers(n: int) -> None:
    rng = random.Random(n)
    for _ in range(6):
        seq = repetitive(rng, 40)
        grown = NgramBans(n, seq[:7])
        for cut in range(7, len(seq) + 1):
            assert set(NgramBans(n, seq[:cut]).banned()) == hf_ngram_banned(seq[:cut], n)
            assert set(grown.banned()) == hf_ngram_banned(seq[:cut], n)
            if cut < len(seq):
                grown.extend([seq[cut]])


def test_no_repeat_ngram_through_the_sampler() -> None:
    """Prompt + output, grown by append_tokens; the banned logits are -inf on greedy and random rows alike."""
    rng = random.Random(0)
    prompt, out = repetitive(rng, 20), repetitive(rng, 10)
    state = SamplingState(2, V, torch.device("cpu"))
    state.add_request(0, SamplingParams(temperature=0.0, no_repeat_ngram_size=2), prompt, out[:3], 1)
    state.add_request(1, SamplingParams(no_repeat_ngram_size=3), prompt, out[:3], 2)
    for k in range(3, len(out)):
        logits = torch.randn(2, V)
        got = compute_processed_logits(logits, state.metadata([0, 1]))
        for row, n in ((0, 2), (1, 3)):
            assert set(torch.isinf(got[row]).nonzero().flatten().tolist()) == hf_ngram_banned(prompt + out[:k], n)
        state.append_tokens([0, 1], [[out[k]], [out[k]]])


# --- DRY ------------------------------------------------------------------------------------------------------------

def ref_dry(ctx: list[int], mult: float, base: float, allowed: int, last_n: int,
            breakers: list[list[int]]) -> dict[int, float]:
    """llama.cpp's DRY written out plainly: the window, the restart limit, each earlier position's repeat found by
    walking back, the maximum per following token, the penalty with its exponent clamp."""
    w = len(ctx) if last_n == -1 else min(len(ctx), last_n)
    if mult == 0 or last_n == 0 or w <= allowed:
        return {}
    win = ctx[len(ctx) - w:]
    rep_limit = w
    for i in range(w):  # i tokens back from the end
        longest = -1
        for b in breakers:
            tail = b[1:]
            if b[0] == win[w - 1 - i] and longest < len(tail) <= i and all(
                    tail[o] == win[w - 1 - i + o + 1] for o in range(len(tail))):
                longest = len(tail)
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < allowed:
        return {}
    best: dict[int, int] = {}
    for j in range(w - 1):
        n = 0
        while n <= j and win[j - n] == win[w - 1 - n]:
            n += 1
        n = min(n, rep_limit)
        if n >= allowed:
            best[win[j + 1]] = max(best.get(win[j + 1], -1), n)
    singles = {b[0] for b in breakers if len(b) == 1}
    max_exp = int(88.7228391 / math.log(base)) if base > 1.000001 else 0
    return {t: mult * base ** (min(n - allowed, max_exp) if max_exp > 0 else n - allowed)
            for t, n in best.items() if t not in singles}


def dry_map(state: DryState) -> dict[int, float]:
    ids, vals = state.penalties()
    return dict(zip(ids, vals))


def test_dry_llama_cpp_example() -> None:
    """The example in llama.cpp's comments: `a b c c b c y a b c` has repeat counts 0 0 3 1 0 2 0 0 0 0, so c would
    extend a repeat of 3, b one of 1, y one of 2."""
    a, b, c, y = 0, 1, 2, 3
    ctx = [a, b, c, c, b, c, y, a, b, c]
    got = dry_map(DryState(1.0, 2.0, 1, -1, [], ctx))
    assert got == {c: 2.0 ** 2, b: 2.0 ** 0, y: 2.0 ** 1}
    assert dry_map(DryState(1.0, 2.0, 2, -1, [], ctx)) == {c: 2.0, y: 1.0}


CONFIGS = [  # (multiplier, base, allowed_length, last_n, breakers)
    (0.8, 1.75, 2, -1, []),
    (0.8, 1.75, 2, -1, [[3]]),  # a single-token breaker: limits repeats and is never penalised
    (1.0, 2.0, 1, 16, [[2, 3]]),  # a two-token breaker, a window
    (0.5, 1.1, 3, 9, [[1], [2, 0, 1]]),
    (2.0, 1000.0, 0, -1, []),  # huge base: the exponent clamp
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_dry_matches_reference(cfg) -> None:
    mult, base, allowed, last_n, breakers = cfg
    rng = random.Random(str(cfg))
    for _ in range(5):
        seq = repetitive(rng, 60, alphabet=5)
        grown = DryState(mult, base, allowed, last_n, breakers, seq[:5])
        for cut in range(5, len(seq) + 1):
            want = ref_dry(seq[:cut], mult, base, allowed, last_n, breakers)
            assert dry_map(DryState(mult, base, allowed, last_n, breakers, seq[:cut])) == pytest.approx(want)
            assert dry_map(grown) == pytest.approx(want)
            if cut < len(seq):
                grown.extend([seq[cut]])


def test_dry_through_the_sampler() -> None:
    """The sampler subtracts exactly DRY's penalties after the other penalties, per row; rows without DRY untouched."""
    rng = random.Random(4)
    prompt, out = repetitive(rng, 30, alphabet=5), repetitive(rng, 8, alphabet=5)
    p = SamplingParams(temperature=0.0, dry_multiplier=0.8, dry_allowed_length=2)
    p.dry_sequence_breaker_ids = [[4]]
    state = SamplingState(2, V, torch.device("cpu"))
    state.add_request(0, p, prompt, out[:2], 1)
    state.add_request(1, SamplingParams(temperature=0.0), prompt, out[:2], 2)
    for k in range(2, len(out)):
        logits = torch.randn(2, V)
        got = compute_processed_logits(logits, state.metadata([0, 1]))
        want = logits.clone()
        for t, pen in ref_dry(prompt + out[:k], 0.8, 1.75, 2, -1, [[4]]).items():
            want[0, t] -= pen
        torch.testing.assert_close(got, want)
        state.append_tokens([0, 1], [[out[k]], [out[k]]])


BAD = [({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size"), ({"no_repeat_ngram_size": 65}, "no_repeat_ngram_size"),
       ({"dry_multiplier": -0.1}, "dry_multiplier"), ({"dry_base": 0.5}, "dry_base"),
       ({"dry_allowed_length": -1}, "dry_allowed_length"), ({"dry_penalty_last_n": -2}, "dry_penalty_last_n"),
       ({"dry_sequence_breakers": [""]}, "dry_sequence_breakers"),
       ({"dry_sequence_breakers": ["x" * 41]}, "dry_sequence_breakers"),
       ({"dry_sequence_breakers": ["a"] * 65}, "dry_sequence_breakers")]


@pytest.mark.parametrize(("kw", "name"), BAD)
def test_repeat_knob_ranges(kw, name) -> None:
    with pytest.raises(ValueError, match=f"^{name}"):
        SamplingParams(**kw)


def test_repeat_knobs_follow_output() -> None:
    """Rows with either knob never verify drafts and rebuild their metadata each step."""
    assert SamplingParams(no_repeat_ngram_size=3).depends_on_output(0)
    assert SamplingParams(dry_multiplier=0.5).depends_on_output(0)
    assert not SamplingParams(dry_multiplier=0.5, dry_penalty_last_n=0).depends_on_output(0)
