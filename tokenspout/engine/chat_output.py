"""A chat reply's text → the message's parts: reasoning, content and tool calls (what the reasoning and tool
parsers make of it), for the whole reply (`final`) or as stream deltas (`delta`).

Both parsers are pure functions of the text so far, so a stream is a diff of successive parses and reassembles to
the non-streamed message.  With neither parser the text is content, untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenspout.outputs import MessageParts
from tokenspout.reasoning import ReasoningParser
from tokenspout.tool_parsers import ToolCallStream, ToolParser


@dataclass(slots=True)
class DeltaParts:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class ChatOutputParser:
    """One choice's parser.  `tool_parser` is None when the request has no tools (or tool_choice "none")."""

    def __init__(self, tool_parser: ToolParser | None, reasoning: ReasoningParser | None,
                 calls_only: bool = False) -> None:
        """`calls_only`: the answer holds tool calls only (ChatPlan.calls_only): what the tool parser leaves as
        content (a call cut off before its name, as written: `<tool_call>\n{"name`) is dropped."""
        self.tool_parser = tool_parser
        self.reasoning = reasoning
        self.calls_only = calls_only
        self._text = ""
        self._reasoning_sent = ""
        self._answer_sent = ""
        self._calls = ToolCallStream(tool_parser) if tool_parser is not None else None

    @property
    def active(self) -> bool:
        return self.tool_parser is not None or self.reasoning is not None

    def _split(self, text: str, final: bool) -> tuple[str | None, str]:
        if self.reasoning is None:
            return None, text
        s = self.reasoning.split(text, final)
        return s.reasoning, s.answer

    def final(self, text: str) -> MessageParts:
        reasoning, answer = self._split(text, True)
        if self.tool_parser is None:
            # content is None only beside reasoning (as with a tool parser below): an empty reply without any is
            # "", as it is with no reasoning parser at all.
            return MessageParts(answer if answer or not reasoning else None, reasoning or None)
        parse = self.tool_parser.parse(answer, True)
        calls = [{"id": self.tool_parser.new_call_id(), "type": "function",
                  "function": {"name": c.name, "arguments": c.arguments}} for c in parse.tool_calls()]
        content = "" if self.calls_only else parse.content
        return MessageParts(content or (None if calls or reasoning else ""), reasoning or None, calls)

    def delta(self, new_text: str, final: bool) -> DeltaParts:
        """The parts `new_text` (appended to the reply so far) adds; `final` on the reply's last output."""
        self._text += new_text
        reasoning, answer = self._split(self._text, final)
        out = DeltaParts()
        if reasoning is not None and reasoning.startswith(self._reasoning_sent):
            out.reasoning = reasoning[len(self._reasoning_sent):]
            self._reasoning_sent = reasoning
        if self._calls is None:
            if answer.startswith(self._answer_sent):
                out.content = answer[len(self._answer_sent):]
                self._answer_sent = answer
        else:
            out.content, out.tool_calls = self._calls.update(answer, final)
            if self.calls_only:
                out.content = ""
        return out

    @property
    def called_tools(self) -> bool:
        return self._calls is not None and self._calls.num_calls > 0


def tool_finish_reason(finish_reason: str | None, stop_reason: int | str | None, called_tools: bool) -> str | None:
    """"tool_calls" where a reply that called tools ended by itself (EOS, or its tool grammar complete).  A stop
    string the client asked for keeps "stop" with that string: it may have cut a call short (its arguments are then
    partial, as a call cut by max_tokens is), which "tool_calls" would report as a finished call."""
    if called_tools and finish_reason == "stop" and not isinstance(stop_reason, str):
        return "tool_calls"
    return finish_reason
