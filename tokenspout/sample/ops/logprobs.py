"""Logprobs of the sampled token, its rank, and the top-N, for the whole batch at once."""

from __future__ import annotations

import torch


def gather_logprobs(
    logprobs: torch.Tensor, sampled: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logprobs [R, V], sampled [R] -> (ids [R, n+1], values [R, n+1], ranks [R]).

    Column 0 is the sampled token, then the n best tokens, best first (one topk with the batch's largest
    n; rows that asked for fewer are sliced by the caller).  The rank is the number of tokens whose
    logprob is >= the sampled token's (1 = best; tokens tied with it count, as in vLLM)."""
    token = sampled.unsqueeze(-1)
    token_lp = logprobs.gather(1, token)
    # Summing into int32 avoids the int64 copy of the whole mask that bool.sum() makes.
    ranks = (logprobs >= token_lp).sum(-1, dtype=torch.int32).to(torch.int64)
    if n <= 0:
        return token, token_lp, ranks
    top_lp, top_ids = logprobs.topk(n, -1)
    return torch.cat([token, top_ids], 1), torch.cat([token_lp, top_lp], 1), ranks
