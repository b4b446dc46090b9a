"""Reasoning budgets on the frontend: `thinking_token_budget` and `reasoning_effort` need a reasoning parser (it
knows the markers and whether the reply starts inside the reasoning); the engine forces the end marker
(sample/ops/thinking.py)."""

from __future__ import annotations

from tokenspout.reasoning import THINK_START, ReasoningParser
from tokenspout.sampling_params import SamplingParams

# reasoning_effort -> thinking_token_budget (README "Reasoning" documents them)
EFFORT_BUDGETS = {"low": 256, "medium": 1024, "high": 4096}


def apply_budget(params: SamplingParams, reasoning: ReasoningParser | None) -> None:
    """Sets the markers the engine needs on `params` (in place), or raises ValueError naming the field."""
    if params.thinking_token_budget is None:
        return
    if reasoning is None:
        raise ValueError("thinking_token_budget: the server has no reasoning parser, so it cannot tell where the "
                         "reasoning ends (start it with --reasoning-parser deepseek_r1 or qwen3)")
    if reasoning.starts_in_answer():  # the prompt switched thinking off: there is no reasoning to bound
        params.thinking_token_budget = None
        return
    params.reasoning_end = reasoning.end_marker
    params.reasoning_start = None if (reasoning.opens_in_reasoning or reasoning.prompt_opened) else THINK_START
