"""hermes: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call (Hermes 2 Pro,
Qwen2.5, Qwen3, QwQ).  Text around the blocks is content."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenspout.tool_parsers.base import ParsedCall, ToolParse, ToolParser, assemble, call_from_object, held_back
from tokenspout.tool_parsers.grammar import HEADER, WS, call_schema, free_text_until, literal
from tokenspout.tool_parsers.json_scan import Malformed, in_string, loads, skip_ws, value_end

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    start_markers = (START,)

    def parse(self, text: str, final: bool) -> ToolParse:
        items: list[str | ParsedCall] = []
        pos = 0
        text_open = True
        while True:
            i = text.find(START, pos)
            if i < 0:
                items.append(text[pos:])
                break
            items.append(text[pos:i])
            j = self._end_marker(text, i + len(START), final)
            # An open block stops short of a tail that may be the start of its end marker.
            block_end = len(held_back(text, (END,))) if j < 0 else j
            call = self._call(text[:block_end], i + len(START), final or j >= 0, cut=final and j < 0)
            if call is None:  # malformed or cut off: the block is content, as written
                items.append(text[i:block_end + (len(END) if j >= 0 else 0)])
            else:
                items.append(call)
            if j < 0:
                text_open = False
                break
            pos = j + len(END)
        return assemble(items, text_open and isinstance(items[-1], str), final, self.start_markers)

    @staticmethod
    def _end_marker(text: str, pos: int, final: bool) -> int:
        """Where the block whose JSON starts after `pos` ends (-1: not yet).  Usually the first END; but a string
        argument may hold the text "</tool_call>" (code, docs), and an END inside the call's JSON string is not
        the block's end: cutting the block there would turn a valid call into content."""
        j = text.find(END, pos)
        start = skip_ws(text, pos)
        if j < 0 or not text.startswith("{", start):
            return j
        try:
            end = value_end(text, start)
            if end is not None:
                if end > j:  # END lies inside the object: in one of its strings, if the object is valid JSON
                    loads(text[start:end])
                    return text.find(END, end)
                return j
        except Malformed:
            return j
        # The object is still open: an END inside a string that is still open may yet be part of an argument.
        return -1 if not final and in_string(text, start, j) else j

    @staticmethod
    def _call(text: str, pos: int, closed: bool, cut: bool = False) -> ParsedCall | None:
        """The call in a block whose JSON starts after `pos`; `closed`: the block can grow no more."""
        pos = skip_ws(text, pos)
        if pos >= len(text):
            return None if closed else ParsedCall(None, "", False)
        try:
            call, end = call_from_object(text, pos, closed, cut_ok=cut)
        except Malformed:
            return None if closed else ParsedCall(None, "", False)
        if end is not None and text[end:].strip():  # more than the call's object in the block
            return None if closed else ParsedCall(None, "", False)
        return call

    def grammar(self, tools: Sequence[Mapping[str, Any]], *, required: bool, parallel: bool,
                special_token_ids: Mapping[str, int]) -> str:
        call = f"{literal(START + chr(10))} body {literal(chr(10) + END)}"
        more = f'("\\n" {call})*' if parallel else ""
        lines = [HEADER.rstrip(), f"body: {call_schema(tools)}"]
        if required:
            lines.insert(1, f"start: {call} {more}")
        else:
            lines.insert(1, f"start: TAIL | head {literal(chr(10))} body {literal(chr(10) + END)} {more} {WS}")
            lines += free_text_until(START)
        return "\n".join(lines) + "\n"
