"""Stop strings, found on decoded text by the frontend (the engine only knows stop token ids).

Rules (vLLM semantics, written out):
* Only generated text is searched, never the prompt.
* Each check looks at the new characters plus len(stop) - 1 characters of look-back, so a stop string that spans
  two tokens (or two engine steps) is found, and the whole text is never re-scanned.
* When several stop strings match, the one that ends first wins (that is the one a token-by-token stream would have
  seen first); on a tie the one that starts first (the longer) wins.  This makes the result independent of how many
  tokens arrive per step.
* Without include_stop_str_in_output the text is cut at the start of the match; with it, at its end.  The same flag
  decides whether the text of a stop token (EOS, stop_token_ids) the engine ended on is shown: RequestState reads it
  here, so a detokenized request always has a StopChecker (with no stop strings it finds nothing, holds nothing back).
* Streaming never shows any part of a stop string that will be cut: `holdback()` says how many trailing characters
  must stay unsent.  It returns the length of the longest suffix that is a proper prefix of some stop string, which
  is at most max(len(stop)) - 1 and usually 0, so ordinary text streams without delay.  Any future match must begin
  inside that suffix, so everything before it is final.  Each stop string's Knuth-Morris-Pratt automaton follows
  the text as it grows, so a call costs the new characters, whatever the stop strings (testing each place the suffix
  could start cost a 4000-character text with 64 stop strings of 120k characters 45 ms a call on the event loop,
  audit 2026-11-27; a stop string is at most MAX_STOP_CHARS long, which bounds building the automata).
* min_tokens (applied by the caller): a match only counts if it ends in text produced by a token after the first
  min_tokens tokens; the look-back may still reach into earlier text (vLLM PR #22014).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class StopMatch:
    stop: str  # the stop string that matched
    start: int  # where it starts in the text
    end: int  # one past where it ends


class StopChecker:
    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = tuple(dict.fromkeys(stop))  # dedupe, keep order
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_len = max((len(s) for s in self.stop), default=0)
        # holdback()'s automata, built on its first call (non-streamed requests never need them)
        self._fail: list[list[int]] | None = None
        self._state: list[int] = []  # per stop string: the longest suffix of _seen that is a proper prefix of it
        self._seen = ""  # the text the states describe

    def find(self, text: str, new_start: int) -> StopMatch | None:
        """The first-ending match that ends after position `new_start` (the first new character)."""
        best: StopMatch | None = None
        for s in self.stop:
            i = text.find(s, max(0, new_start - len(s) + 1))
            if i < 0:
                continue
            m = StopMatch(s, i, i + len(s))
            if best is None or (m.end, m.start) < (best.end, best.start):
                best = m
        return best

    def truncate_to(self, match: StopMatch) -> int:
        """Length of the text to keep once `match` is found."""
        return match.end if self.include_stop_str_in_output else match.start

    def holdback(self, text: str) -> int:
        """How many trailing characters of unfinished `text` a stream must not send yet."""
        if self.include_stop_str_in_output or not text:
            return 0
        if self._fail is None:
            self._fail = [_prefix_function(s) for s in self.stop]
            self._state = [0] * len(self.stop)
        seen, state = self._seen, self._state
        if not text.startswith(seen):  # (a text that does not extend the last one: follow it from the start)
            seen, state[:] = "", [0] * len(state)
        new = text[len(seen):]
        for j, s in enumerate(self.stop):
            k = state[j]
            if not k and s[0] not in new:
                continue  # (no prefix of s can start in the new text: the common case, at C speed)
            fail, last = self._fail[j], len(s) - 1
            for ch in new:
                while k and s[k] != ch:
                    k = fail[k - 1]
                if s[k] == ch:
                    k += 1
                    if k > last:  # the whole string (find() reports it): keep its longest proper border
                        k = fail[last]
            state[j] = k
        self._seen = text
        return max(self._state, default=0)


def _prefix_function(s: str) -> list[int]:
    """fail[i]: the length of the longest proper prefix of s[:i + 1] that is also its suffix (KMP)."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail
