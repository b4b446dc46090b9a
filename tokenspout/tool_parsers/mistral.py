"""mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral 7B v0.3, Mistral Nemo/Small; the
marker is a special token).  Text before the marker is content."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenspout.tool_parsers.base import (
    ParsedCall,
    ToolParse,
    ToolParser,
    assemble,
    call_from_object,
    nine_char_id,
)
from tokenspout.tool_parsers.grammar import HEADER, WS, call_schema, free_text_until, marker
from tokenspout.tool_parsers.json_scan import Malformed, skip_ws

MARKER = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    start_markers = (MARKER,)
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> ToolParse:
        i = text.find(MARKER)
        if i < 0:
            return assemble([text], True, final, self.start_markers)
        items: list[str | ParsedCall] = [text[:i]]
        try:
            items += self._calls(text, i + len(MARKER), final)
        except Malformed:
            if final:
                return assemble([text], False, True, ())
            items.append(ParsedCall(None, "", False))
        return assemble(items, isinstance(items[-1], str), final, self.start_markers)

    @staticmethod
    def _calls(text: str, pos: int, final: bool) -> list[str | ParsedCall]:
        pos = skip_ws(text, pos)
        if pos >= len(text):
            if final:
                raise Malformed("no calls after the marker")
            return [ParsedCall(None, "", False)]
        single = text[pos] == "{"  # some models write one object without the list
        if not single:
            if text[pos] != "[":
                raise Malformed("expected '[' after the marker")
            pos += 1
        calls: list[str | ParsedCall] = []
        while True:
            pos = skip_ws(text, pos)
            if pos >= len(text):
                if final and not calls:
                    raise Malformed("the call list was cut off")
                return calls or [ParsedCall(None, "", False)]  # cut after a call: the calls stand
            call, end = call_from_object(text, pos, final, cut_ok=True)
            calls.append(call)
            if end is None or single:
                return calls if end is None else calls + [text[end:]]
            pos = skip_ws(text, end)
            if pos >= len(text):
                return calls  # the list not closed yet, or cut by the end of the reply: the calls stand
            if text[pos] == "]":
                return calls + [text[pos + 1:]]
            if text[pos] != ",":
                raise Malformed("expected ',' or ']' between calls")
            pos += 1

    def grammar(self, tools: Sequence[Mapping[str, Any]], *, required: bool, parallel: bool,
                special_token_ids: Mapping[str, int]) -> str:
        calls = '"[" body ("," body)* "]"' if parallel else '"[" body "]"'
        lines = [HEADER.rstrip(), f"body: {call_schema(tools)}"]
        mark = marker(MARKER, special_token_ids)
        if required:
            lines.insert(1, f"start: {mark} {calls}")
        elif MARKER in special_token_ids:  # free text cannot contain a special token: no lazy trigger needed
            lines.insert(1, f"start: FREE | FREE {mark} {calls} {WS}")
            lines.append("FREE: /(?s:.*)/")
        else:
            lines.insert(1, f"start: TAIL | head {calls} {WS}")
            lines += free_text_until(MARKER)
        return "\n".join(lines) + "\n"

    def new_call_id(self) -> str:
        return nine_char_id()

