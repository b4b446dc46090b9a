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
  inside that suffix, so everything before it is final.
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
        n = len(text)
        held = 0
        for s in self.stop:
            # A suffix text[i:] that is a proper prefix of s must start at a copy of s[0], within len(s) - 1 of the end.
            i = max(0, n - len(s) + 1)
            first = s[0]
            while True:
                i = text.find(first, i)
                if i < 0 or n - i <= held:
                    break
                if s.startswith(text[i:]):
                    held = n - i
                    break
                i += 1
        return held
