"""Streaming tool calls as OpenAI's deltas: each step diffs the parse of the text so far against what was sent.

OpenAI's shape: a call's first delta carries its index, id, type and name (arguments ""), later ones argument
fragments only.  Content grows by appending only (the parser holds back what could still become a call), and a
call is sent once its name is complete, so nothing sent is ever taken back (but see `update`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenspout.tool_parsers.base import ToolParse, ToolParser


@dataclass(slots=True)
class _Sent:
    id: str
    name: str
    arguments: str = ""


@dataclass(slots=True)
class ToolCallStream:
    parser: ToolParser
    content: str = ""
    sent: list[_Sent] = field(default_factory=list)

    def update(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool-call deltas) for the whole text so far.  A started call that turns out malformed
        (possible only without the grammar) cannot be taken back: it stays, and its text is not repeated as content
        unless the final parse puts it there."""
        return self.diff(self.parser.parse(text, final))

    def diff(self, parse: ToolParse) -> tuple[str, list[dict[str, Any]]]:
        delta = ""
        if parse.content.startswith(self.content):
            delta = parse.content[len(self.content):]
            self.content = parse.content
        deltas: list[dict[str, Any]] = []
        for i, call in enumerate(parse.calls):
            if call.name is None:
                break  # calls go out in order: a later one waits for this one's name
            if i == len(self.sent):
                self.sent.append(_Sent(self.parser.new_call_id(), call.name))
                deltas.append({"index": i, "id": self.sent[i].id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            sent = self.sent[i]
            if sent.name == call.name and call.arguments.startswith(sent.arguments) \
                    and len(call.arguments) > len(sent.arguments):
                fragment = call.arguments[len(sent.arguments):]
                sent.arguments = call.arguments
                if deltas and deltas[-1]["index"] == i and "id" in deltas[-1]:
                    deltas[-1]["function"]["arguments"] = fragment
                else:
                    deltas.append({"index": i, "function": {"arguments": fragment}})
        return delta, deltas

    @property
    def num_calls(self) -> int:
        return len(self.sent)
