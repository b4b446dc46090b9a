"""The tool-parser interface: the model's text so far → (content, tool calls), as a pure function of the text.

Because `parse(text, final)` depends on nothing but the text, streaming is a diff of successive parses
(`ToolCallStream`) and the non-streamed answer is the final parse of the same text: a streamed reply reassembles to
the non-streamed one by construction.  What a parser may still turn into a call is held back from `content` while
the text grows: the tail that could be the start of a start marker (the stop-string hold-back idea), and whitespace
next to a call.
"""

from __future__ import annotations

import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tokenspout.tool_parsers.json_scan import Malformed, loads, object_members

ARGUMENT_KEYS = ("arguments", "parameters")  # Llama 3.1 writes "parameters"


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str | None  # None until the name string is complete
    arguments: str  # the arguments' JSON text so far (the model's own text; "{}" when a complete call has none)
    complete: bool


@dataclass(slots=True)
class ToolParse:
    content: str  # text outside calls that can be shown now
    calls: list[ParsedCall] = field(default_factory=list)  # final=True: complete calls, and a named cut-off one

    def tool_calls(self) -> list[ParsedCall]:
        """The calls of a final parse: complete ones, and one cut off by the end of the reply (named)."""
        return [c for c in self.calls if c.name is not None]


def held_back(text: str, markers: Sequence[str]) -> str:
    """`text` without a tail that could still grow into one of `markers`."""
    for n in range(min(len(text), max(map(len, markers), default=0)), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) and m != tail for m in markers):
            return text[:-n]
    return text


def call_from_object(text: str, pos: int, final: bool, cut_ok: bool = False) -> tuple[ParsedCall, int | None]:
    """The call written as a JSON object at `text[pos]` ({"name": ..., "arguments": {...}}): (call, end), end the
    index after the object or None while it is open.  Raises Malformed when it can never be a call.  `cut_ok`: at
    the end of the reply (final) an object the text stops inside (max_tokens) is still a call once its name is
    complete, with its arguments as far as they were written (OpenAI's behaviour, and what a stream has already
    sent of it); else it is malformed."""
    members, end = object_members(text, pos)
    name: str | None = None
    args = None
    for m in members:
        if m.key == "name" and m.end is not None:
            value = loads(text[m.start:m.end])
            if not isinstance(value, str) or not value:
                raise Malformed("a tool call's name must be a non-empty string")
            name = value
        elif m.key in ARGUMENT_KEYS and args is None:
            args = m
    if end is not None:
        loads(text[pos:end])  # the whole object, strictly (value_end only checked nesting)
        if name is None:
            raise Malformed("a tool call needs a name")
        if args is None:
            return ParsedCall(name, "{}", True), end
        raw = text[args.start:args.end]
        value = loads(raw)
        if isinstance(value, str):  # arguments written as a JSON string holding the JSON text
            raw = value
            # ...which must hold a JSON object too: `"arguments": "hello"` would hand the client arguments that
            # are not JSON at all.
            value = loads(raw)
        if not isinstance(value, dict):
            raise Malformed("a tool call's arguments must be a JSON object")
        return ParsedCall(name, raw, True), end
    if final and not (cut_ok and name is not None):
        raise Malformed("the tool call's JSON was cut off")
    if name is None or args is None or text[args.start] != "{":
        return ParsedCall(name, "", False), None
    return ParsedCall(name, text[args.start:args.end if args.end is not None else len(text)], False), None


class ToolParser(ABC):
    """One model family's way of writing tool calls.  Subclasses live one per file and register by `name`
    (vLLM's --tool-call-parser names)."""

    name: ClassVar[str]
    start_markers: ClassVar[tuple[str, ...]]  # text that opens a call; held back from content while it may grow
    # Markers that are special tokens vanish from the text when special tokens are skipped: such a parser needs
    # the text with special tokens kept.
    needs_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def parse(self, text: str, final: bool) -> ToolParse:
        """The content and calls of `text`.  With final=False the text may still grow: what could still become a
        call is held back from content, and the last call may be incomplete.  With final=True, a call that does
        not parse (malformed or cut off) is returned as content, in place."""

    @abstractmethod
    def grammar(self, tools: Sequence[Mapping[str, Any]], *, required: bool, parallel: bool,
                special_token_ids: Mapping[str, int]) -> str:
        """A Lark grammar (llguidance's dialect) for the calls in this format: with `required`, the output is
        calls only; else free text, and once the start marker is written, the constrained calls.
        `special_token_ids`: markers that are one special token, referenced by id (`<[id]>`)."""

    def bind_tools(self, tools: Sequence[Mapping[str, Any]] | None) -> None:
        """The request's tools, for a format whose text does not say the arguments' types (qwen3_coder's XML
        values); most parsers need nothing.  Called once on each request's own parser."""

    def new_call_id(self) -> str:
        return "chatcmpl-tool-" + secrets.token_hex(16)


def nine_char_id() -> str:
    """Mistral's templates insist on 9 alphanumeric characters."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))


def assemble(items: list[str | ParsedCall], text_open: bool, final: bool,
             markers: Sequence[str]) -> ToolParse:
    """Content and calls from a parser's items in text order (text segments and calls).  `text_open`: the last
    item is text that ends the output (it may still grow into a marker).  Whitespace next to a call is dropped
    and the text between calls is joined by newlines; with no call the content is the text itself."""
    # Adjacent text items (e.g. a malformed block kept as content, then the text after it) are one run of text:
    # joining them by the newline meant for text on either side of a call would insert a newline into it.
    merged: list[str | ParsedCall] = []
    for it in items:
        if isinstance(it, str) and merged and isinstance(merged[-1], str):
            merged[-1] += it
        else:
            merged.append(it)
    items = merged
    calls = [it for it in items if isinstance(it, ParsedCall)]
    texts = [it for it in items if isinstance(it, str)]
    if not calls:
        body = "".join(texts)
        if not final:
            body = held_back(body, markers).rstrip()
        return ToolParse(body)
    pieces = []
    for i, it in enumerate(items):
        if not isinstance(it, str):
            continue
        if text_open and i == len(items) - 1 and not final:
            it = held_back(it, markers).rstrip()
        before = i > 0 and isinstance(items[i - 1], ParsedCall)
        after = i + 1 < len(items) and isinstance(items[i + 1], ParsedCall)
        it = it.lstrip() if before else it
        it = it.rstrip() if after else it
        if it:
            pieces.append(it)
    return ToolParse("\n".join(pieces), calls)
