"""Masks on float32 logits [B, V], in place: allowed token ids, the grammar bitmask, bans (bad words,
min_tokens) and logit_bias.

Bans and bias touch only the (row, token) pairs a request names, so a batch pays for those tokens, not for
B x V (a dense [64, 128k] pass costs 2-5 ms on this CPU).  `allowed_token_ids` and the grammar bitmask are
the exceptions: by nature they decide about every token of their rows.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


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
