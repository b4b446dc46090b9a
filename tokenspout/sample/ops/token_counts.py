"""Per-slot seen-token sets with output counts, kept incrementally for the penalties.

A dense [max_reqs, V] count table would cost 64 x 128k x 4 bytes of traffic per step to use; instead each
slot keeps the distinct tokens of its prompt and output in a padded row of `ids`, with the number of
times each occurred in the output in `counts`.  A host-side dict maps token -> column so that
`append` only touches the new tokens (one index_put for the counts, one for new ids), never rebuilding
from the token lists.  Only slots with a penalty are tracked.
"""

from __future__ import annotations

import torch


class SeenTokens:
    def __init__(self, max_slots: int, device: torch.device, capacity: int = 256) -> None:
        self.device = device
        self.ids = torch.zeros(max_slots, capacity, dtype=torch.int64, device=device)
        self.counts = torch.zeros(max_slots, capacity, dtype=torch.float32, device=device)
        self.lengths = [0] * max_slots
        self._cols: list[dict[int, int] | None] = [None] * max_slots

    @property
    def capacity(self) -> int:
        return self.ids.shape[1]

    def tracked(self, slot: int) -> bool:
        return self._cols[slot] is not None

    def _grow(self, need: int) -> None:
        if need <= self.capacity:
            return
        cap = self.capacity
        while cap < need:
            cap *= 2
        ids = torch.zeros(self.ids.shape[0], cap, dtype=self.ids.dtype, device=self.device)
        counts = torch.zeros(self.ids.shape[0], cap, dtype=self.counts.dtype, device=self.device)
        ids[:, : self.capacity] = self.ids
        counts[:, : self.capacity] = self.counts
        self.ids, self.counts = ids, counts

    def reset(self, slot: int, prompt: list[int], output: list[int]) -> None:
        """Start tracking `slot` from scratch (a new request, or one resumed after preemption)."""
        cols: dict[int, int] = {}
        out_counts: dict[int, int] = {}
        for t in prompt:
            cols.setdefault(t, len(cols))
        for t in output:
            cols.setdefault(t, len(cols))
            out_counts[t] = out_counts.get(t, 0) + 1
        self._grow(len(cols))
        n = len(cols)
        self.ids[slot].zero_()
        self.counts[slot].zero_()
        if n:
            self.ids[slot, :n] = torch.tensor(list(cols), dtype=torch.int64, device=self.device)
            cnt = [float(out_counts.get(t, 0)) for t in cols]
            self.counts[slot, :n] = torch.tensor(cnt, dtype=torch.float32, device=self.device)
        self.lengths[slot] = n
        self._cols[slot] = cols

    def clear(self, slot: int) -> None:
        self._cols[slot] = None
        self.lengths[slot] = 0

    def append(self, slots: list[int], token_ids: list[list[int]]) -> None:
        """Counts the tokens each tracked slot just emitted."""
        inc_r: list[int] = []
        inc_c: list[int] = []
        new_r: list[int] = []
        new_c: list[int] = []
        new_t: list[int] = []
        for slot, toks in zip(slots, token_ids):
            cols = self._cols[slot]
            if cols is None:
                continue
            for t in toks:
                c = cols.get(t)
                if c is None:
                    c = cols[t] = len(cols)
                    new_r.append(slot)
                    new_c.append(c)
                    new_t.append(t)
                inc_r.append(slot)
                inc_c.append(c)
            self.lengths[slot] = len(cols)
        if not inc_r:
            return
        if new_r:
            self._grow(max(self.lengths[s] for s in new_r))
            idx = (torch.tensor(new_r, device=self.device), torch.tensor(new_c, device=self.device))
            self.ids.index_put_(idx, torch.tensor(new_t, dtype=torch.int64, device=self.device))
        idx = (torch.tensor(inc_r, device=self.device), torch.tensor(inc_c, device=self.device))
        one = torch.ones(len(inc_r), dtype=self.counts.dtype, device=self.device)
        self.counts.index_put_(idx, one, accumulate=True)

    def gather(self, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Padded [len(slots), L] (ids, output counts, seen) of tracked slots; see PenaltyBatch."""
        width = max(1, max(self.lengths[s] for s in slots))
        idx = torch.tensor(slots, device=self.device)
        ids = self.ids.index_select(0, idx)[:, :width]
        counts = self.counts.index_select(0, idx)[:, :width]
        lengths = torch.tensor([self.lengths[s] for s in slots], device=self.device)
        real = torch.arange(width, device=self.device) < lengths.unsqueeze(-1)
        ids = torch.where(real, ids, ids[:, :1])
        # A row with no seen token at all: every entry is "unseen" with count 0, so it writes back unchanged.
        seen = (lengths > 0).unsqueeze(-1).expand(-1, width)
        counts = torch.where(real, counts, counts[:, :1]) * seen
        return ids, counts, seen

    def dense_counts(self, slot: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(output counts [V], seen-in-prompt-or-output mask [V]) of one slot, for tests and debugging."""
        n = self.lengths[slot]
        counts = torch.zeros(vocab, dtype=torch.float32, device=self.device)
        seen = torch.zeros(vocab, dtype=torch.bool, device=self.device)
        counts[self.ids[slot, :n]] = self.counts[slot, :n]
        seen[self.ids[slot, :n]] = True
        return counts, seen
