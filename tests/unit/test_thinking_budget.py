"""thinking_token_budget / reasoning_effort: the engine forces the end-of-reasoning marker after the budget (on greedy
and random rows, through the real sampler), the state is a function of the output (rebuilt after preemption), and
the server refuses a budget it cannot honour (no reasoning parser, completions) with a 400 naming the field."""

from __future__ import annotations

import pytest
import torch

from tests.unit.fake_engine import FakeEngine
from tokenspout.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, OpenAIServingError
from tokenspout.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenspout.sample.ops.thinking import DONE, THINK, ThinkingBudget
from tokenspout.sample.sampler import Sampler
from tokenspout.sampling_params import SamplingParams
from tokenspout.worker.sampling_state import SamplingState

V = 32
END = [5, 6]  # the end marker's tokens
START = [7]


def budget_params(budget: int, start: list[int] | None, **kw) -> SamplingParams:
    p = SamplingParams(thinking_token_budget=budget, **kw)
    p.reasoning_end_token_ids, p.reasoning_start_token_ids = END, start
    return p


def run(params: list[SamplingParams], steps: int, script: list[list[int | None]] | None = None) -> list[list[int]]:
    """Steps of the real sampler; the markers' tokens are nearly impossible unless forced (or scripted: a step's
    token made certain by its logits)."""
    state = SamplingState(len(params), V, torch.device("cpu"))
    for i, p in enumerate(params):
        state.add_request(i, p, [1, 2], [], 100 + i)
    rows = list(range(len(params)))
    out: list[list[int]] = [[] for _ in params]
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        logits = torch.randn(len(params), V, generator=g)
        logits[:, END + START] = -30.0
        for r in rows:
            want = script[r][step] if script and step < len(script[r]) else None
            if want is not None:
                logits[r, want] = 50.0
        toks = Sampler()(logits, state.metadata(rows)).sampled_token_ids.tolist()
        for r in rows:
            out[r].append(toks[r])
        state.append_tokens(rows, [[t] for t in toks])
    return out


@pytest.mark.parametrize("budget", [0, 3])
def test_end_marker_forced_after_the_budget(budget: int) -> None:
    greedy, rand = budget_params(budget, None, temperature=0.0), budget_params(budget, None, top_p=0.9)
    for toks in run([greedy, rand, SamplingParams(top_k=5)], budget + 6)[:2]:
        assert not set(toks[:budget]) & set(END)
        assert toks[budget:budget + 2] == END  # forced, then free again (the answer)
        assert not set(toks[budget + 2:]) & set(END)


def test_budget_counts_from_the_start_marker() -> None:
    """qwen3-style replies: reasoning only after the start marker; the budget counts from there."""
    p = budget_params(2, START)
    (toks,) = run([p], 8, [[None, None, 7]])
    assert toks[2] == 7 and toks[5:7] == END and not set(toks[:5]) & set(END)


def test_marker_written_by_the_model_ends_the_budget() -> None:
    p = budget_params(4, None)
    (toks,) = run([p], 9, [[None, 5, 6]])
    assert toks[1:3] == END and not set(toks[3:]) & set(END)  # nothing forced afterwards


def test_state_is_a_function_of_the_output() -> None:
    """After preemption the state is rebuilt from the output tokens: the same as grown token by token."""
    out = [3, 7, 9, 9, 9, 5, 6, 2]
    grown = ThinkingBudget(10, START, END, [])
    for k, t in enumerate(out):
        again = ThinkingBudget(10, START, END, out[:k])
        assert (again.phase, again.count) == (grown.phase, grown.count)
        grown.extend([t])
    assert grown.phase == DONE and grown.count == 4  # 9 9 9 and the marker's first token (not yet known as one)
    forcing = ThinkingBudget(2, None, END, [9, 9])
    assert forcing.phase == THINK and forcing.forced_now() == 5
    forcing.extend([5])
    assert ThinkingBudget(2, None, END, [9, 9, 5]).forced_now() == 6 == forcing.forced_now()


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kw})


@pytest.mark.parametrize("field,value", [("thinking_token_budget", 50), ("reasoning_effort", "low")])
def test_without_a_reasoning_parser_a_400_says_why(field, value) -> None:
    with pytest.raises(OpenAIServingError) as e:
        OpenAIServingChat(FakeEngine()).prepare(chat(**{field: value}))
    assert e.value.status == 400 and e.value.param == field and "reasoning parser" in e.value.message


def test_with_a_reasoning_parser_the_markers_are_set() -> None:
    serving = OpenAIServingChat(FakeEngine(), reasoning_parser="deepseek_r1")
    job = serving.prepare(chat(reasoning_effort="medium"))
    sp = job.params
    assert (sp.thinking_token_budget, sp.reasoning_end, sp.reasoning_start) == (1024, "</think>", None)
    assert serving.prepare(chat(thinking_token_budget=7)).params.thinking_token_budget == 7
    qwen = OpenAIServingChat(FakeEngine(), reasoning_parser="qwen3").prepare(chat(reasoning_effort="high")).params
    assert (qwen.thinking_token_budget, qwen.reasoning_start) == (4096, "<think>")


def test_budget_field_errors() -> None:
    with pytest.raises(OpenAIServingError) as e:
        chat(reasoning_effort="low", thinking_token_budget=3).to_sampling_params()
    assert e.value.param == "reasoning_effort"
    with pytest.raises(OpenAIServingError) as e:
        chat(thinking_token_budget=-1).to_sampling_params()
    assert e.value.param == "thinking_token_budget"
    with pytest.raises(OpenAIServingError) as e:
        CompletionRequest(prompt="x", thinking_token_budget=3).to_sampling_params()
    assert e.value.param == "thinking_token_budget" and "chat" in e.value.message
    with pytest.raises(ValueError):
        chat(reasoning_effort="extreme")
