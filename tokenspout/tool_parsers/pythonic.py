"""pythonic: a reply that is a Python list of calls with keyword arguments, `[get_weather(city="Paris"), f()]`
(Llama 3.2 / Llama 4 with their pythonic templates; Llama 4 may wrap it in `<|python_start|>` ... `<|python_end|>`).
A reply that does not open with `[` is content; so is one that turns out not to be such a list (at the end: while
it streams, a call announced before the list broke stays, as with the other parsers).  Text after the list is
content.

Arguments are Python literals (strings, numbers, True / False / None, lists, dicts, tuples), sent as JSON.  While a
call streams, its arguments grow as `{"k": v, ...` one complete argument at a time and close with `}` with the
call, so every streamed fragment is a prefix of the final arguments (ToolCallStream's contract).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from tokenspout.tool_parsers.base import ParsedCall, ToolParse, ToolParser, assemble
from tokenspout.tool_parsers.grammar import HEADER, args_rule, literal
from tokenspout.tool_parsers.json_scan import Malformed, skip_ws

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_CLOSERS = {"(": ")", "[": "]", "{": "}"}


def _value_end(text: str, pos: int) -> int | None:
    """The end of the Python literal at `text[pos]`: the index of the top-level `,` or `)` after it (None while
    the text may still grow into more of it)."""
    stack: list[str] = []
    i = pos
    while i < len(text):
        c = text[i]
        if c in "'\"":
            quote = text[i:i + 3] if text[i:i + 3] in ('"""', "'''") else c
            j = i + len(quote)
            while True:
                if j >= len(text):
                    return None
                if text[j] == "\\":
                    j += 2
                    continue
                if text.startswith(quote, j):
                    break
                j += 1
            i = j + len(quote)
            continue
        if c in _CLOSERS:
            stack.append(_CLOSERS[c])
        elif c in ")]}":
            if not stack:
                return i if c == ")" else _malformed("unbalanced brackets in an argument")
            if stack.pop() != c:
                _malformed("unbalanced brackets in an argument")
        elif c == "," and not stack:
            return i
        i += 1
    return None


def _malformed(why: str) -> NoReturn:
    raise Malformed(why)


def _json_value(source: str) -> str:
    try:
        value = ast.literal_eval(source.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise Malformed(f"not a Python literal: {source.strip()[:40]!r}") from None
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):  # a set, bytes, complex, NaN, non-string keys: no JSON for it
        raise Malformed("an argument has no JSON form") from None


def _call(text: str, pos: int) -> tuple[ParsedCall, int | None]:
    """The call at `text[pos]`: (call, the index after its `)`, or None while open)."""
    m = _IDENT.match(text, pos)
    if m is None:
        return (ParsedCall(None, "", False), None) if pos >= len(text) else _malformed("a call starts with a name")
    i = m.end()
    if i >= len(text):
        return ParsedCall(None, "", False), None  # the name may still grow
    if text[i] != "(":
        _malformed("a call's name is followed by '('")
    name, args, i = m.group(), "{", i + 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return ParsedCall(name, args, False), None
        if text[i] == ")":
            return ParsedCall(name, args + "}", True), i + 1
        k = _IDENT.match(text, i)
        if k is None:
            _malformed("arguments are keyword arguments")
        eq = skip_ws(text, k.end())
        if eq >= len(text):
            return ParsedCall(name, args, False), None
        if text[eq] != "=" or "." in k.group() or "-" in k.group():
            _malformed("arguments are keyword arguments")
        end = _value_end(text, eq + 1)
        if end is None:
            return ParsedCall(name, args, False), None
        args += ("" if args == "{" else ", ") + json.dumps(k.group()) + ": " + _json_value(text[eq + 1:end])
        i = end + 1 if text[end] == "," else end


class PythonicToolParser(ToolParser):
    name = "pythonic"
    start_markers = ("[", PYTHON_START)

    def parse(self, text: str, final: bool) -> ToolParse:
        start = skip_ws(text, 0)
        if text.startswith(PYTHON_START, start):
            start = skip_ws(text, start + len(PYTHON_START))
        elif not final and text[start:] and PYTHON_START.startswith(text[start:]):
            return ToolParse("")  # may still become the tag
        if start >= len(text):
            return ToolParse(text if final else "")
        if text[start] != "[":
            return ToolParse(text if final else text.rstrip())
        try:
            calls, end = self._calls(text, start + 1)
        except Malformed:
            return ToolParse(text if final else text.rstrip())  # not a list of calls: all of it is content
        if final and (not calls or (end is None and calls[-1].name is None)):
            return ToolParse(text)  # "[]", or cut off before a call was named
        if end is None:
            return ToolParse("", calls)
        # Text after the list is content (the calls stand, as with the other parsers); a closing tag is dropped.
        rest = text[end:]
        if rest.lstrip().startswith(PYTHON_END):
            rest = rest.lstrip()[len(PYTHON_END):]
        items: list[str | ParsedCall] = [*calls, rest]
        return assemble(items, True, final, (PYTHON_END,))

    @staticmethod
    def _calls(text: str, pos: int) -> tuple[list[ParsedCall], int | None]:
        """The calls of the list whose items start at `pos`, and the index after its `]` (None while open)."""
        calls: list[ParsedCall] = []
        while True:
            pos = skip_ws(text, pos)
            if pos >= len(text):
                return calls, None
            if text[pos] == "]":
                return calls, pos + 1
            call, end = _call(text, pos)
            calls.append(call)
            if end is None:
                return calls, None
            pos = skip_ws(text, end)
            if pos < len(text) and text[pos] == ",":
                pos += 1
            elif pos < len(text) and text[pos] != "]":
                _malformed("calls are separated by ','")

    def grammar(self, tools: Sequence[Mapping[str, Any]], *, required: bool, parallel: bool,
                special_token_ids: Mapping[str, int]) -> str:
        """Calls in Python syntax, each function's declared arguments by name: required ones in the schema's
        order, then optional ones (in order, each at most once); top-level types follow the schema (string,
        integer, number, boolean, null, enum / const), nested values are any literal."""
        lines = [HEADER.rstrip()]
        calls = '"[" call (", " call)* "]"' if parallel else '"[" call "]"'
        lines.append(f"start: {calls}" if required else f"start: FREE | {calls}")
        alternatives = []
        for t, tool in enumerate(tools):
            fn = tool["function"]
            params = fn.get("parameters") or {}
            props: dict[str, Any] = params.get("properties") or {}
            kw = {}
            for a, arg in enumerate(props):
                kw[arg] = f"kw_{t}_{a}"
                lines.append(f"{kw[arg]}: {literal(arg + '=')} {_value_rule(props[arg])}")
            lines.append(f"args_{t}: {args_rule(params, kw)}")
            lines.append(f"call_{t}: {literal(fn['name'] + '(')} args_{t} \")\"")
            alternatives.append(f"call_{t}")
        lines.append(f"call: {' | '.join(alternatives)}")
        lines += [
            'value: PYSTR | PYNUM | "True" | "False" | "None" | "[" (value (", " value)*)? "]"'
            ' | "{" (PYSTR ": " value (", " PYSTR ": " value)*)? "}"',
            'PYSTR: /"([^"\\\\\\n]|\\\\.)*"/',
            "PYINT: /-?(0|[1-9][0-9]*)/",
            "PYNUM: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/",
        ]
        if not required:
            lines.append("FREE: /([ \\t\\r\\n]*[^\\[ \\t\\r\\n](?s:.*))?/")  # an answer: anything not opening a list
        return "\n".join(lines) + "\n"


def _value_rule(schema: Any) -> str:
    if not isinstance(schema, Mapping):
        return "value"
    if "enum" in schema or "const" in schema:
        options = schema.get("enum", [schema.get("const")])
        try:
            return "(" + " | ".join(literal(_py_literal(v)) for v in options) + ")"
        except (TypeError, ValueError):
            return "value"
    kind = schema.get("type")
    return {"string": "PYSTR", "integer": "PYINT", "number": "PYNUM", "boolean": '("True" | "False")',
            "null": '"None"'}.get(kind, "value") if isinstance(kind, str) else "value"


def _py_literal(value: Any) -> str:
    """A JSON value as Python source (json.dumps' strings are valid Python string literals)."""
    if value is True:
        return "True"
    if value is False:
        return "False"
    if value is None:
        return "None"
    if isinstance(value, str | int | float):
        return json.dumps(value, ensure_ascii=False)
    raise TypeError("only scalar enum values")
