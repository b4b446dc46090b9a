"""Repetition knobs that follow the row's whole token history: no_repeat_ngram_size and DRY, kept incrementally per
request on the host (SamplingState owns one per slot), so that a step costs O(context) numpy work per row, not a
rescan in Python.

- NgramBans (transformers' NoRepeatNGramLogitsProcessor): the tokens that would complete an n-gram already present in
  prompt + output.  A table {(n-1)-gram: next tokens} grows by one entry per token; the step's bans are one lookup.
- DryState (llama.cpp's llama_sampler_dry, from koboldcpp): for each earlier position j of the last `last_n` tokens
  the length m(j) of the longest run ending at j that equals the context's end (capped at the window and at the
  distance back to the last sequence breaker); token c[j + 1] would extend that repeat and is penalised
  multiplier * base ** (max m - allowed_length), exponent clamped so the penalty stays finite; tokens that are
  single-token breakers are never penalised.  m is kept for every position and updated per appended token t by
  the recurrence m'(j) = m(j - 1) + 1 if c[j] == t else 0 (the suffix-match lengths llama.cpp recomputes each step
  with a reversed Z-algorithm), so a step is a few vectorised passes over the window.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

FLOAT_MAX_LOG = 88.7228391  # log of float32's largest value: llama.cpp's clamp of DRY's exponent


class NgramBans:
    def __init__(self, n: int, tokens: list[int]) -> None:
        self.n = n
        self.tokens: list[int] = []
        self.table: defaultdict[tuple[int, ...], set[int]] = defaultdict(set)
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        n = self.n
        for t in tokens:
            self.tokens.append(t)
            if len(self.tokens) >= n:
                self.table[tuple(self.tokens[-n:-1])].add(t)

    def banned(self) -> list[int]:
        """The tokens that would repeat an n-gram (none until n - 1 tokens exist, as transformers)."""
        if len(self.tokens) < self.n - 1:
            return []
        key = tuple(self.tokens[len(self.tokens) - self.n + 1:])
        return sorted(self.table.get(key, ()))


class DryState:
    """DRY's state for one request: the context (the last `last_n` tokens, or all) and m per position in growable
    buffers (a token appends in O(window) vectorised work, no reallocation), and the positions of breaker heads so that
    the step's breaker scan looks only at those (np.isin over the window cost ~60 us a row)."""

    def __init__(self, multiplier: float, base: float, allowed_length: int, last_n: int,
                 breakers: list[list[int]], tokens: list[int]) -> None:
        self.multiplier, self.base, self.allowed = multiplier, base, allowed_length
        self.last_n = last_n  # -1: the whole context
        # head token -> tails (the rest of each breaker's tokens); single-token breakers have an empty tail
        self.breakers: dict[int, list[list[int]]] = {}
        for seq in breakers:
            if seq:
                self.breakers.setdefault(seq[0], []).append(list(seq[1:]))
        self.single = {h for h, tails in self.breakers.items() if any(not t for t in tails)}
        self.max_exp = int(FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else 0
        self._ctx = np.zeros(0, dtype=np.int64)  # buffers; the live part is [:self._n]
        self._m = np.zeros(0, dtype=np.int64)  # m[j]: the repeat ending at j (m at the end itself is unused)
        self._n = 0
        self._heads: list[int] = []  # positions of breaker heads in the live part, ascending
        self._init(tokens)

    @property
    def ctx(self) -> np.ndarray:
        return self._ctx[:self._n]

    def _init(self, tokens: list[int]) -> None:
        """m for a whole history at once: the Z-function of the reversed sequence (z[k] = m[L - 1 - k]).  With a
        window only its tokens are kept: a repeat is capped at the window's start anyway, and the window only moves
        forward."""
        c = tokens[-self.last_n:] if self.last_n > 0 else tokens
        n = len(c)
        s = c[::-1]
        z = [0] * n
        lt = rt = 0
        for k in range(1, n):
            if k < rt:
                z[k] = min(rt - k, z[k - lt])
            while k + z[k] < n and s[z[k]] == s[k + z[k]]:
                z[k] += 1
            if k + z[k] > rt:
                lt, rt = k, k + z[k]
        cap = max(2 * n, 64)
        self._ctx = np.zeros(cap, dtype=np.int64)
        self._m = np.zeros(cap, dtype=np.int64)
        self._ctx[:n] = c
        self._m[:n] = z[::-1]
        self._n = n
        self._heads = [j for j, t in enumerate(c) if t in self.breakers]

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            n = self._n
            if n == len(self._ctx):
                self._grow()
                n = self._n
            c, m = self._ctx, self._m
            if n:  # m'(j) = m(j - 1) + 1 where c[j] == t, else 0 (right to left: m[j - 1] is still the old value)
                m[1:n] = np.where(c[1:n] == t, m[:n - 1] + 1, 0)
                m[0] = int(c[0] == t)
            m[n] = 0
            c[n] = t
            if t in self.breakers:
                self._heads.append(n)
            self._n = n + 1

    def _grow(self) -> None:
        """Room for more tokens: a windowed state drops everything before its window (a repeat is capped at the
        window's start anyway, see _init), an unwindowed one doubles its buffers."""
        n = self._n
        keep = n if self.last_n <= 0 else min(n, self.last_n)
        drop = n - keep
        cap = max(2 * keep, 64)
        ctx, m = np.zeros(cap, dtype=np.int64), np.zeros(cap, dtype=np.int64)
        ctx[:keep], m[:keep] = self._ctx[drop:n], self._m[drop:n]
        if drop:
            m[:keep] = np.minimum(m[:keep], np.arange(1, keep + 1))  # as if the context started at the window
        self._ctx, self._m, self._n = ctx, m, keep
        self._heads = [j - drop for j in self._heads if j >= drop]

    def _rep_limit(self, w: int) -> int:
        """The distance back (within the last w tokens) to the newest complete breaker, as llama.cpp's step 1."""
        c = self._ctx
        end = self._n - 1
        first = self._n - w
        for pos in reversed(self._heads):  # only breaker heads need a look, newest first
            if pos < first:
                break
            i = end - pos
            longest = -1
            for tail in self.breakers[int(c[pos])]:
                k = len(tail)
                if longest < k <= i and all(tail[o] == c[pos + o + 1] for o in range(k)):
                    longest = k
            if longest >= 0:
                return i - longest
        return w

    def penalties(self) -> tuple[list[int], list[float]]:
        """(token ids, penalties to subtract from their logits) for the next token."""
        total = self._n
        w = total if self.last_n < 0 else min(total, self.last_n)
        if w <= self.allowed:
            return [], []
        limit = self._rep_limit(w) if self.breakers else w
        if limit < self.allowed:
            return [], []
        start = total - w
        # rep(j) = min(m[j], j - start + 1, limit) >= allowed: only positions with m[j] >= allowed can qualify
        cand = np.flatnonzero(self._m[start:total - 1] >= self.allowed)
        if not cand.size:
            return [], []
        rep = np.minimum(np.minimum(self._m[start + cand], cand + 1), limit)
        hit = rep >= self.allowed
        if not hit.any():
            return [], []
        best: dict[int, int] = {}
        for tok, r in zip(self._ctx[start + cand[hit] + 1].tolist(), rep[hit].tolist()):
            if r > best.get(tok, -1):
                best[tok] = r
        ids, vals = [], []
        for tok, r in sorted(best.items()):
            if tok in self.single:
                continue
            e = r - self.allowed
            if self.max_exp > 0:
                e = min(e, self.max_exp)
            ids.append(tok)
            vals.append(self.multiplier * self.base ** e)
        return ids, vals
