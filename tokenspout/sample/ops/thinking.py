"""thinking_token_budget in the engine: after `budget` reasoning tokens the end-of-reasoning marker is forced.

Per request, a small state machine over its output tokens (rebuilt from them after preemption, so nothing has to be
carried): WAIT for the start marker's tokens (only when the reply does not start inside the reasoning, e.g. the
qwen3 parser), THINK counting reasoning tokens until the model writes the end marker itself (DONE) or the count
reaches the budget (FORCE: the end marker's tokens are the only allowed ones, one per step, on greedy and random
rows alike; then DONE and the answer follows).  The markers are the reasoning parser's, tokenized by the frontend
Processor; a marker the model spells with other tokens than that tokenization is not recognised (the budget then
forces the marker after it).
"""

from __future__ import annotations

WAIT, THINK, FORCE, DONE = range(4)


class ThinkingBudget:
    def __init__(self, budget: int, start_ids: list[int] | None, end_ids: list[int], output: list[int]) -> None:
        self.budget = budget
        self.start_ids = list(start_ids or [])
        self.end_ids = list(end_ids)
        self.phase = WAIT if self.start_ids else THINK
        self.count = 0  # reasoning tokens so far
        self.forced = 0  # end-marker tokens forced so far
        self._tail: list[int] = []
        self.extend(output)

    def _ends_with(self, seq: list[int]) -> bool:
        return bool(seq) and self._tail[-len(seq):] == seq

    def extend(self, tokens: list[int]) -> None:
        keep = max(len(self.start_ids), len(self.end_ids))
        for t in tokens:
            self._tail = (self._tail + [t])[-keep:]
            self._start_forcing()  # (a replay after preemption meets the forced tokens here)
            if self.phase == WAIT:
                if self._ends_with(self.start_ids):
                    self.phase = THINK
            elif self.phase == THINK:
                if self._ends_with(self.end_ids):
                    self.phase = DONE
                else:
                    self.count += 1
            elif self.phase == FORCE:
                self.forced += 1
                if self.forced == len(self.end_ids):
                    self.phase = DONE

    def _start_forcing(self) -> None:
        if self.phase == THINK and self.count >= self.budget:
            self.phase, self.forced = FORCE, 0

    def forced_now(self) -> int | None:
        """The token this step must be (None: free)."""
        self._start_forcing()
        return self.end_ids[self.forced] if self.phase == FORCE else None
