"""Masks and argmax-changing processors, applied in place to float32 logits [B, V].

Everything here touches only the (row, token) pairs it concerns -- allowed ids, banned ids, biased ids,
tokens seen before -- so a batch pays for the tokens its requests name, not for B x V (a dense
[64, 128k] pass costs 2-5 ms on this CPU; the penalties below cost microseconds).  The exceptions are
`allowed_token_ids` and the grammar bitmask, which by nature decide about every token of their rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


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


def apply_grammar_bitmask(x: torch.Tensor, bitmask: torch.Tensor) -> None:
    """bitmask [B, ceil(V / 32)] int32, bit j of word i allows token 32 * i + j; the rest become -inf."""
    shifts = torch.arange(32, device=x.device, dtype=torch.int32)
    # `>>` on int32 sign-extends, but `& 1` keeps only the bit we shifted down, so bit 31 reads right too.
    bits = (bitmask.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(x.shape[0], -1)[:, : x.shape[1]].bool()
    x.masked_fill_(~allowed, NEG_INF)


def apply_allowed(x: torch.Tensor, rows: torch.Tensor, local_rows: torch.Tensor, ids: torch.Tensor) -> None:
    """Only ids stay finite on `rows`; (local_rows[i], ids[i]) lists the allowed pairs, local_rows
    indexing into `rows`."""
    keep = torch.zeros(rows.numel(), x.shape[1], dtype=torch.bool, device=x.device)
    keep[local_rows, ids] = True
    x[rows] = x[rows].masked_fill_(~keep, NEG_INF)


def apply_bans(x: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> None:
    """x[rows[i], ids[i]] = -inf (bad words, min_tokens); repeated pairs are harmless."""
    x.index_put_((rows, ids), torch.tensor(NEG_INF, dtype=x.dtype, device=x.device))


def apply_bias(x: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, bias: torch.Tensor) -> None:
    """x[rows[i], ids[i]] += bias[i] (already clamped; pairs are distinct: logit_bias is a dict)."""
    x.index_put_((rows, ids), bias, accumulate=True)


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
