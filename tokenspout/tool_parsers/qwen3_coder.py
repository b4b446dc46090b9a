"""qwen3_coder: Qwen3-Coder's XML calls, one block per call:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is raw text (one newline after its opening tag and before its closing tag is layout, not value),
typed by the function's `parameters` schema: strings stay text, integers / numbers / booleans / null are read as
such, objects and arrays as JSON (or Python literals); a parameter the schema does not type is JSON when it parses
as JSON, else text.  Text around the blocks is content.  While a call streams, its arguments grow as JSON one
complete parameter at a time and close with `</function>`, so every fragment is a prefix of the final arguments.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tokenspout.tool_parsers.base import ParsedCall, ToolParse, ToolParser, assemble, held_back
from tokenspout.tool_parsers.grammar import HEADER, WS, args_rule, free_text_until, literal
from tokenspout.tool_parsers.json_scan import Malformed, skip_ws

START, END = "<tool_call>", "</tool_call>"
FUNCTION_END, PARAM_END = "</function>", "</parameter>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAM = re.compile(r"<parameter=([^>\n]+)>")


def _may_become(text: str, tag: str) -> bool:
    """Whether `text` (all that is written so far) may still grow into `tag` + NAME + ">"."""
    return tag.startswith(text) or (text.startswith(tag) and ">" not in text and "\n" not in text)


def _typed(raw: str, schema: Any) -> Any:
    """A parameter's raw text as the value its schema says (Malformed when it cannot be one)."""
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    text = raw.strip()
    try:
        if kind == "string":
            return raw
        if kind == "integer":
            return int(text)
        if kind == "number":
            value = float(text)
            return int(value) if value.is_integer() and "." not in text and "e" not in text.lower() else value
        if kind == "boolean":
            if text.lower() in ("true", "false"):
                return text.lower() == "true"
            raise ValueError(text)
        if kind == "null":
            if text.lower() in ("null", "none"):
                return None
            raise ValueError(text)
        if kind in ("object", "array"):
            try:
                return json.loads(text)
            except ValueError:
                return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise Malformed(f"parameter value {text[:40]!r} is not of type {kind}") from None
    try:  # untyped: JSON when it is JSON, else the text
        return json.loads(text)
    except ValueError:
        return raw


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    start_markers = (START,)

    def __init__(self) -> None:
        self._schemas: dict[str, dict[str, Any]] = {}  # function name → its parameters' schemas

    def bind_tools(self, tools: Sequence[Mapping[str, Any]] | None) -> None:
        for tool in tools or []:
            fn = tool.get("function") or {}
            props = (fn.get("parameters") or {}).get("properties")
            if isinstance(fn.get("name"), str) and isinstance(props, Mapping):
                self._schemas[fn["name"]] = dict(props)

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
            j = text.find(END, i + len(START))
            block_end = len(held_back(text, (END,))) if j < 0 else j
            try:
                call = self._call(text[i + len(START):block_end], closed=j >= 0 or final)
            except Malformed:
                call = None
            if call is None or (final and call.name is None):  # malformed or cut off unnamed: content as written
                items.append(text[i:block_end + (len(END) if j >= 0 else 0)])
            else:
                items.append(call)
            if j < 0:
                text_open = False
                break
            pos = j + len(END)
        return assemble(items, text_open and isinstance(items[-1], str), final, self.start_markers)

    def _call(self, block: str, closed: bool) -> ParsedCall:
        """The call in one block's text (after <tool_call>); `closed`: the block can grow no more (then an
        unfinished call is one cut off by the end of the reply, kept as far as its parameters were complete)."""
        pos = skip_ws(block, 0)
        m = _FUNCTION.match(block, pos)
        if m is None:
            if not closed and _may_become(block[pos:], "<function="):
                return ParsedCall(None, "", False)
            raise Malformed("a block opens with <function=NAME>")
        name, schemas = m.group(1).strip(), self._schemas.get(m.group(1).strip(), {})
        args, pos = "{", m.end()
        while True:
            pos = skip_ws(block, pos)
            rest = block[pos:]
            if rest.startswith(FUNCTION_END):
                if block[pos + len(FUNCTION_END):].strip():
                    raise Malformed("text after </function> in a block")
                return ParsedCall(name, args + "}", True)
            p = _PARAM.match(block, pos)
            if p is None:
                if not closed and (FUNCTION_END.startswith(rest) or _may_become(rest, "<parameter=")):
                    return ParsedCall(name, args, False)
                if closed and not rest.strip():
                    return ParsedCall(name, args, False)  # cut off between parameters
                raise Malformed("expected <parameter=NAME> or </function>")
            end = block.find(PARAM_END, p.end())
            if end < 0:
                return ParsedCall(name, args, False)  # the value is still being written
            raw = block[p.end():end]
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            key = p.group(1).strip()
            value = _typed(raw, schemas.get(key))
            args += ("" if args == "{" else ", ") + json.dumps(key, ensure_ascii=False) + ": " + \
                json.dumps(value, ensure_ascii=False)
            pos = end + len(PARAM_END)

    def grammar(self, tools: Sequence[Mapping[str, Any]], *, required: bool, parallel: bool,
                special_token_ids: Mapping[str, int]) -> str:
        """The XML blocks with each function's declared parameters (required ones in the schema's order, then
        optional ones); strings are free text up to `</parameter>`, integers / numbers / booleans / enums their
        literals, objects and arrays compact JSON following their schema."""
        lines = [HEADER.rstrip()]
        more = '("\\n" call)*' if parallel else ""
        if required:
            lines.append(f"start: call {more}")
        else:
            lines.append(f"start: TAIL | head {literal(chr(10))} call_body {more} {WS}")
            lines += free_text_until(START)
        bodies = []
        for t, tool in enumerate(tools):
            fn = tool["function"]
            params = fn.get("parameters") or {}
            props: dict[str, Any] = params.get("properties") or {}
            kw = {}
            for a, arg in enumerate(props):
                kw[arg] = f"p_{t}_{a}"
                value = self._value_rule(f"v_{t}_{a}", props[arg], lines)
                lines.append(f"{kw[arg]}: {literal('<parameter=' + arg + '>' + chr(10))} {value} {literal(chr(10))}")
            lines.append(f"args_{t}: {args_rule(params, kw, '')}")
            opening = literal("<function=" + fn["name"] + ">\n")
            lines.append(f"body_{t}: {opening} args_{t} {literal(FUNCTION_END + chr(10) + END)}")
            bodies.append(f"body_{t}")
        lines.append(f"call_body: {' | '.join(bodies)}")
        lines.append(f"call: {literal(START + chr(10))} call_body")
        return "\n".join(lines) + "\n"

    @staticmethod
    def _value_rule(rule: str, schema: Any, lines: list[str]) -> str:
        """The rule of one parameter's value, ending with its closing tag."""
        close = literal(chr(10) + PARAM_END)
        if not isinstance(schema, Mapping):
            schema = {}
        if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
            return "(" + " | ".join(literal(v) for v in schema["enum"]) + f") {close}"
        kind = schema.get("type")
        scalar = {"integer": "/-?(0|[1-9][0-9]*)/", "number": "/-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/",
                  "boolean": '("true" | "false")', "null": '"null"'}
        if isinstance(kind, str) and kind in scalar:
            return f"{scalar[kind]} {close}"
        if kind in ("object", "array"):
            lines.append(f"{rule}: %json " + json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}},
                                                        ensure_ascii=False))
            return f"{rule} {close}"
        # a string (or an untyped value): any text up to the closing tag (a lazy lexeme, as the auto mode's head),
        # at most maxLength characters when the schema bounds it (a small model's text otherwise runs on)
        limit = schema.get("maxLength")
        span = f"{{0,{int(limit)}}}" if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 0 \
            else "*"
        lines += [f"{rule}[lazy]: {rule.upper()}_TEXT {close}", f"{rule.upper()}_TEXT: /(?s:.{span})/"]
        return rule
