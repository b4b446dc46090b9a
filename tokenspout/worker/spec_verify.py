"""Verification of drafted tokens inside the model runner (speculative decoding).

A request with d drafts ran d + 1 query positions this step (its last known token, then the drafts); the logits of
all d + 1 positions go through the same processing as ordinary sampling (masks, logit_bias, temperature, min_p,
top-k, top-p), position by position with the output position advanced by one each (so seeded noise stays a pure
function of seed and position), and then through the exact rejection sampler.  Requests whose processing depends
on the tokens generated so far (penalties, bad words, min_tokens not reached), and requests asking for logprobs
or guidance, are never given drafts (spec_decode/speculator.py `eligible`), which keeps this per-position
processing exact.

Grammars do depend on the tokens so far, and are handled exactly: a grammar request's drafts are cut to the prefix
its grammar accepts (engine core), and the k-th verified position of a request is masked by its grammar advanced
over its first k drafts (the structured output manager fills those rows and rolls the drafts back), so each
position's target distribution is the one plain decoding would sample from after accepting those drafts.
"""

from __future__ import annotations

import torch

from tokenspout.sample.ops import rows_cpu
from tokenspout.sample.rejection_sampler import pack_drafts, pad_positions, probs_from_logits, rejection_sample
from tokenspout.sample.sampler import compute_processed_logits
from tokenspout.worker.sampling_state import SamplingState


class DraftProbs:
    """q of the drafts pending at each persistent row, [max_rows, k, V]: written by the draft model when it
    samples a draft (spec_decode/draft_model.py), read by the verification of the next step with one
    index_select.  Allocated on the first sampled (non-greedy) draft: an all-greedy workload, or n-gram drafts
    (q is a point mass), never need it."""

    def __init__(self, max_rows: int, vocab_size: int) -> None:
        self.max_rows = max_rows
        self.vocab_size = vocab_size
        self._q: torch.Tensor | None = None

    def write(self, rows: list[int], j: int, q: torch.Tensor, k: int) -> None:
        """q [R, V] of draft j (of at most k) at these rows."""
        if self._q is None:
            self._q = torch.zeros(self.max_rows, k, self.vocab_size, dtype=torch.float32)
        self._q[torch.tensor(rows, dtype=torch.int64), j] = q

    def read(self, rows: list[int], width: int) -> torch.Tensor | None:
        """q of the drafts pending at these rows, [R, width, V] (None if no sampled row ever drafted: then
        every row is greedy and q is never read)."""
        if self._q is None:
            return None
        return self._q.index_select(0, torch.tensor(rows, dtype=torch.int64))[:, :width]


def verify_drafts(logits: torch.Tensor, rows: list[int], drafts: list[list[int]],
                  sampling: SamplingState, grammar_bitmask: torch.Tensor | None = None,
                  draft_probs: torch.Tensor | None = None) -> list[list[int]]:
    """logits: [sum(len(d) + 1), V] in request order (each request's drafted positions, then its bonus position);
    grammar_bitmask: one row per such position (see StructuredOutputManager.grammar_bitmask with drafts), or None;
    draft_probs: [B, max len(d), V], the draft model's q of each drafted token (None for n-gram drafts).
    Returns the tokens each request emits (accepted drafts + one recovered or bonus token)."""
    k = max(len(d) for d in drafts)
    counts = [len(d) + 1 for d in drafts]
    expanded = [r for r, c in zip(rows, counts) for _ in range(c)]
    md = sampling.metadata(expanded)
    md.grammar_bitmask = grammar_bitmask
    first = torch.tensor([0] + counts[:-1], dtype=torch.int64).cumsum(0)
    base_positions = md.positions[first].clone()
    md.positions = md.positions + torch.cat([torch.arange(c) for c in counts])
    processed = compute_processed_logits(logits, md)
    draft_ids, num_draft = pack_drafts(drafts, k)
    target = pad_positions(probs_from_logits(processed), num_draft, k)
    argmax = pad_positions(rows_cpu.argmax_rows(rows_cpu.load(), processed).unsqueeze(-1), num_draft, k).squeeze(-1)
    out, num_emitted = rejection_sample(target, draft_ids, draft_probs, num_draft, md.is_greedy[first],
                                        (md.seeds[first], base_positions), any_greedy=md.any_greedy,
                                        all_greedy=md.all_greedy, target_argmax=argmax)
    packed = torch.cat([num_emitted[:, None], out], dim=1).tolist()
    return [row[1 : 1 + row[0]] for row in packed]
