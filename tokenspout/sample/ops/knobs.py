"""RowKnobs: the truncation settings of a set of rows, shared by topk_topp.py (candidate sets) and nucleus.py
(wide top-p nuclei), which both read them; a module of its own so that neither imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class RowKnobs:
    """The truncated rows' settings, and host-side facts that let topk_topp._resolve skip whole steps."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    def select(self, idx: torch.Tensor) -> RowKnobs:
        return RowKnobs(self.temperature[idx], self.top_k[idx], self.top_p[idx], self.min_p[idx],
                        self.any_top_k, self.any_top_p, self.any_min_p)

    def cat(self, other: RowKnobs) -> RowKnobs:
        """These rows, then other's (the host-side facts are the whole truncated batch's, so both carry the same)."""
        return RowKnobs(torch.cat([self.temperature, other.temperature]), torch.cat([self.top_k, other.top_k]),
                        torch.cat([self.top_p, other.top_p]), torch.cat([self.min_p, other.min_p]),
                        self.any_top_k, self.any_top_p, self.any_min_p)
