"""llama3_json: Llama 3.1+ JSON tool calls: the whole reply is `{"name": ..., "parameters": {...}}` (calls
separated by `;`), optionally after `<|python_tag|>`.  A reply that does not start with `{` is content."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenspout.tool_parsers.base import ParsedCall, ToolParse, ToolParser, assemble, call_from_object
from tokenspout.tool_parsers.grammar import HEADER, WS, call_schema
from tokenspout.tool_parsers.json_scan import Malformed, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start_markers = (PYTHON_TAG, "{")
    needs_special_tokens = True  # <|python_tag|> is a special token

    def parse(self, text: str, final: bool) -> ToolParse:
        start = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, start):
            start = skip_ws(text, start + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[start:]):
            return ToolParse("")  # may still become the tag
        if start >= len(text):
            return ToolParse("" if not final else text)
        if text[start] != "{":
            return ToolParse(text if final else text.rstrip())
        items: list[str | ParsedCall] = []
        pos = start
        while True:
            try:
                call, end = call_from_object(text, pos, final, cut_ok=True)
            except Malformed:
                # Not (or no longer) a call: at the end, what is left is content; while it grows, hold it back.
                if final:
                    items.append(text[pos:] if items else text)
                    break
                items.append(ParsedCall(None, "", False))
                break
            items.append(call)
            if end is None:
                break
            pos = skip_ws(text, end)
            if pos < len(text) and text[pos] == ";":
                pos = skip_ws(text, pos + 1)
            if pos >= len(text) or text[pos] != "{":
                items.append(text[pos:])
                break
        return assemble(items, isinstance(items[-1], str), final, ())

    def grammar(self, tools: Sequence[Mapping[str, Any]], *, required: bool, parallel: bool,
                special_token_ids: Mapping[str, int]) -> str:
        calls = 'body ("; " body)*' if parallel else "body"
        start = f"start: {calls}" if required else f"start: FREE | {calls} {WS}"
        lines = [HEADER.rstrip(), start, f"body: {call_schema(tools, 'parameters')}"]
        if not required:
            lines.append("FREE: /([ \\t\\r\\n]*[^{ \\t\\r\\n](?s:.*))?/")  # an answer: anything not opening a call
        return "\n".join(lines) + "\n"
