"""Pieces of the Lark grammars (llguidance's dialect) that constrain tool calls, shared by the parsers.

A call is one JSON object {"name": <one of the tools>, "<args key>": <that tool's parameters schema>}, compiled by
llguidance's `%json` (compact, the name first so a streamed call can show its name early).  In "auto" mode the text
before the start marker is free and the marker triggers the constrained call (llguidance's lazy lexeme); text that
never writes the marker is an answer, unconstrained.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from tokenspout.structured_output.backend import lark_regex_escape

HEADER = "%llguidance {}\n"
WS = "/[ \\t\\r\\n]*/"


def call_schema(tools: Sequence[Mapping[str, Any]], args_key: str = "arguments") -> str:
    """`%json {...}` for a call to any of `tools`; each function's `parameters` schema is enforced (strict or not:
    the constraint is what makes a small model's calls parse), with no undeclared top-level arguments."""
    options = []
    for tool in tools:
        fn = tool["function"]
        params = dict(fn.get("parameters") or {"type": "object", "properties": {}})
        # A function's parameters are its signature: an argument it does not declare would fail the call, so
        # undeclared ones are closed off unless the schema itself allows them.
        params.setdefault("additionalProperties", False)
        options.append({"type": "object",
                        "properties": {"name": {"const": fn["name"]}, args_key: params},
                        "required": ["name", args_key], "additionalProperties": False})
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def literal(text: str) -> str:
    """A Lark string literal (JSON escapes are valid Lark escapes)."""
    return json.dumps(text, ensure_ascii=False)


def marker(text: str, special_token_ids: Mapping[str, int]) -> str:
    """A start marker: by token id when it is one special token (whose bytes the lexer never sees), else text."""
    token_id = special_token_ids.get(text)
    return f"<[{token_id}]>" if token_id is not None else literal(text)


def free_text_until(trigger: str) -> list[str]:
    """Rules for "free text, then the trigger": `head` ends at the first trigger (lazy), `TAIL` is text that never
    writes it."""
    return [
        f"head[lazy]: TEXT {literal(trigger)}",
        "TEXT: /(?s:.*)/",
        f"TAIL: /(?s:.*)/ & ~/(?s:.*){lark_regex_escape(trigger)}(?s:.*)/",
    ]

