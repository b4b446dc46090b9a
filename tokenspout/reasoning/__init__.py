"""Reasoning parsers (`--reasoning-parser NAME`, vLLM's names): the model's text → (reasoning, answer).

Both formats write the reasoning between `<think>` and `</think>`; they differ in where it starts:
* `deepseek_r1` (DeepSeek-R1 and its distills, QwQ, Qwen3 "thinking" releases): the chat template often writes
  `<think>` itself, so the reply starts inside the reasoning; a reply with no `</think>` is all reasoning.
* `qwen3`: the model writes `<think>` itself; a reply that does not open with it is all answer.
In both, a rendered prompt that already closed the reasoning (Qwen3's `enable_thinking: false` writes an empty
`<think>\\n\\n</think>` into it) means the reply is all answer, and one that ends with `<think>` means the reply starts
inside the reasoning.  Like `parse` of the tool parsers, `split` is a pure function of the text: a streamed split
is a diff of successive splits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tokenspout.tool_parsers.base import held_back

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningSplit:
    reasoning: str  # shown so far (a possible partial end marker held back)
    answer: str  # the text after the end marker (empty until it is written)
    ended: bool  # whether the reasoning is over (the answer has begun)


class ReasoningParser:
    name: ClassVar[str]
    opens_in_reasoning: ClassVar[bool]  # whether a reply starts inside the reasoning when the prompt does not say

    def __init__(self, prompt: str = "") -> None:
        tail = prompt.rstrip()
        self.prompt_closed = tail.endswith(THINK_END)  # thinking switched off in the prompt
        self.prompt_opened = tail.endswith(THINK_START)

    @property
    def end_marker(self) -> str:
        return THINK_END

    def starts_in_answer(self) -> bool:
        return self.prompt_closed

    @property
    def optional_start(self) -> str | None:
        """The marker that opens the reasoning when the reply may skip it (qwen3), else None (the reply starts
        inside the reasoning)."""
        return None if self.opens_in_reasoning or self.prompt_opened else THINK_START

    def split(self, text: str, final: bool) -> ReasoningSplit:
        if self.prompt_closed:
            return ReasoningSplit("", text, True)
        body = text.lstrip()
        # May still become the start marker.  That includes a text of whitespace only: sending it (as reasoning or
        # answer) before a `<think>` that follows it would leave it in the stream but out of the final split.
        if not final and THINK_START.startswith(body) and body != THINK_START:
            return ReasoningSplit("", "", False)
        if body.startswith(THINK_START):
            body = body[len(THINK_START):]
        elif not (self.opens_in_reasoning or self.prompt_opened):
            return ReasoningSplit("", text, True)
        else:
            body = text
        end = body.find(THINK_END)
        if end >= 0:
            return ReasoningSplit(body[:end], body[end + len(THINK_END):], True)
        return ReasoningSplit(body if final else held_back(body, (THINK_END,)), "", False)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    opens_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    opens_in_reasoning = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def reasoning_parser_class(name: str | None) -> type[ReasoningParser] | None:
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}; got {name!r}")
    return REASONING_PARSERS[name]
