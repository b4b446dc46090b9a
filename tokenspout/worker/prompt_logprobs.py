"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs), scored on the prefill's own hidden states.

A step that prefills prompt positions of a request asking for them also projects those positions (not only the last
one of the chunk, DESIGN invariant 1's exception): position p's float32 log_softmax scores prompt token p + 1, with
its rank and the position's top-N.  Nothing is computed twice: the hidden states are the ones the prefill made, and
the results join the step's one device->host transfer (ModelRunner._to_python).

The projection runs in slices of SLICE_ROWS positions so a long chunk never holds [chunk, vocab] logits at once
(2048 x 49152 float32 would be 400 MB).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenspout.engine.messages import PromptLogprobs
from tokenspout.tensors import long_tensor

SLICE_ROWS = 256
_FLOOR = -9999.0  # JSON has no -inf: vLLM's floor


@dataclass(slots=True)
class PromptLogprobsPlan:
    """The prompt positions a step scores, built by ModelRunner.prepare: request i scores counts[i] positions from
    prompt position starts[i], which sit at hidden_idx[offset_i : offset_i + counts[i]] of the step's tokens."""

    request_ids: list[str]
    starts: list[int]
    counts: list[int]
    num_top: list[int]  # N of each request
    hidden_idx: torch.Tensor  # [M] rows of the step's hidden states
    targets: torch.Tensor  # [M] the prompt token each row scores (the next one)

    @property
    def width(self) -> int:
        """Columns of score()'s result: logprob, rank, then N ids and N logprobs for the largest N."""
        return 2 + 2 * max(self.num_top)


class PlanBuilder:
    """Collects the scored ranges while ModelRunner.prepare walks a step's entries."""

    __slots__ = ("counts", "idx", "ids", "num_top", "starts", "targets")

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.starts: list[int] = []
        self.counts: list[int] = []
        self.num_top: list[int] = []
        self.idx: list[int] = []
        self.targets: list[int] = []

    def add(self, request_id: str, prompt: list[int], lo: int, hi: int, flat_offset: int, num_top: int) -> None:
        """Positions lo..hi-1 of the prompt, whose first sits at flat token `flat_offset` of the step."""
        self.ids.append(request_id)
        self.starts.append(lo)
        self.counts.append(hi - lo)
        self.num_top.append(num_top)
        self.idx.extend(range(flat_offset, flat_offset + hi - lo))
        self.targets.extend(prompt[lo + 1 : hi + 1])

    def build(self) -> PromptLogprobsPlan | None:
        if not self.ids:
            return None
        return PromptLogprobsPlan(self.ids, self.starts, self.counts, self.num_top, long_tensor(self.idx),
                                  long_tensor(self.targets))


@torch.inference_mode()
def score(plan: PromptLogprobsPlan, hidden: torch.Tensor,
          logits_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """[M, width] float64 (token ids are exact in float64): each scored position's prompt-token logprob, its rank,
    then the top-N ids and logprobs, best first (columns past a request's own N are ignored)."""
    m, k = plan.targets.shape[0], max(plan.num_top)
    out = torch.empty(m, plan.width, dtype=torch.float64)
    for a in range(0, m, SLICE_ROWS):
        b = min(a + SLICE_ROWS, m)
        lp = torch.log_softmax(logits_fn(hidden[plan.hidden_idx[a:b]]).float(), dim=-1)
        token_lp = lp.gather(1, plan.targets[a:b, None])
        out[a:b, 0] = token_lp[:, 0]
        # rank = tokens at least as likely as the prompt token (1 = best), as the sampler's logprobs count it
        out[a:b, 1] = (lp >= token_lp).sum(-1, dtype=torch.int32)
        if k:
            top_lp, top_ids = lp.topk(k, dim=-1)
            out[a:b, 2 : 2 + k] = top_ids
            out[a:b, 2 + k :] = top_lp
    out[:, 0].clamp_(min=_FLOOR)
    if k:
        out[:, 2 + k :].clamp_(min=_FLOOR)
    return out


def unpack(plan: PromptLogprobsPlan, flat: list[float]) -> dict[str, PromptLogprobs]:
    """score()'s result, brought to Python as one flat list, as one PromptLogprobs per request."""
    width, k = plan.width, max(plan.num_top)
    result: dict[str, PromptLogprobs] = {}
    row = 0
    for rid, start, count, n in zip(plan.request_ids, plan.starts, plan.counts, plan.num_top):
        lps: list[float] = []
        ranks: list[int] = []
        top_ids: list[int] = []
        top_lps: list[float] = []
        for r in range(row, row + count):
            base = r * width
            lps.append(flat[base])
            ranks.append(int(flat[base + 1]))
            if n:
                top_ids.extend(int(t) for t in flat[base + 2 : base + 2 + n])
                top_lps.extend(flat[base + 2 + k : base + 2 + k + n])
        result[rid] = PromptLogprobs(start, lps, ranks, top_ids, top_lps)
        row += count
    return result
