"""Repetition, presence and frequency penalties, applied in place to float32 logits [B, V].

They touch only the tokens each row has seen before (prompt and output), so a batch pays for those tokens,
not for B x V (a dense [64, 128k] pass costs 2-5 ms on this CPU; the penalties cost microseconds).  The
masks (allowed ids, grammar, bans, logit_bias) are in masks.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PenaltyBatch:
    """Penalty inputs of the rows that have any penalty, as padded [Rp, L] views of the seen tokens.

    Padding repeats column 0 of the row (its id, count and `seen` flag), so a padded entry computes and
    writes back exactly what column 0 writes: duplicates in the scatter agree and nothing is clobbered."""

    rows: torch.Tensor  # [Rp] batch rows
    ids: torch.Tensor  # [Rp, L] int64 tokens seen in prompt or output
    counts: torch.Tensor  # [Rp, L] float32 occurrences in the output (0 for prompt-only tokens)
    seen: torch.Tensor  # [Rp, L] bool: the entry is a real seen token (False only for rows with none)
    repetition: torch.Tensor  # [Rp] float32, 1 = off
    presence: torch.Tensor  # [Rp] float32, 0 = off
    frequency: torch.Tensor  # [Rp] float32, 0 = off
    any_repetition: bool
    any_additive: bool  # any presence or frequency penalty


def apply_penalties(x: torch.Tensor, p: PenaltyBatch) -> None:
    """Repetition penalty (HF: divide positive / multiply negative logits of tokens seen in prompt or
    output), then presence and frequency (OpenAI: logit -= frequency * count + presence * (count > 0),
    output tokens only)."""
    r = p.rows.unsqueeze(-1)
    g = x[r, p.ids]
    new = g
    if p.any_repetition:
        rep = p.repetition.unsqueeze(-1)
        new = torch.where(p.seen, torch.where(g < 0, g * rep, g / rep), g)
    if p.any_additive:
        new = new - p.frequency.unsqueeze(-1) * p.counts - p.presence.unsqueeze(-1) * (p.counts > 0)
    x[r, p.ids] = new
