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


def _has_ref(value: Any) -> bool:
    if isinstance(value, dict):
        return "$ref" in value or any(_has_ref(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_ref(v) for v in value)
    return False


def _rebase_refs(value: Any, rebase: Any) -> Any:
    if isinstance(value, dict):
        return {k: rebase(v) if k == "$ref" and isinstance(v, str) else _rebase_refs(v, rebase)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_rebase_refs(v, rebase) for v in value]
    return value


def _hoisted(params: dict[str, Any], index: int, defs: dict[str, Any]) -> dict[str, Any]:
    """`params` moved into the call schema's root `$defs` (as `t<index>`, its own `$defs` / `definitions` as
    `t<index>.<name>`), its local `$ref`s rewritten to match; returns the `$ref` that stands in its place.  A
    schema's `$ref`s point from its own root, which inside the call schema is no longer the document's root
    (vLLM-test finding: `$defs` / `$ref` parameters were a 400)."""
    base = f"t{index}"
    own = {**params.get("$defs", {}), **params.get("definitions", {})}

    def rebase(ref: str) -> str:
        for prefix in ("#/$defs/", "#/definitions/"):
            if ref.startswith(prefix):
                return f"#/$defs/{base}.{ref[len(prefix):]}"
        return f"#/$defs/{base}{ref[1:]}" if ref.startswith("#") else ref  # "#" and "#/properties/..."

    body = {k: v for k, v in params.items() if k not in ("$defs", "definitions")}
    defs[base] = _rebase_refs(body, rebase)
    for name, schema in own.items():
        defs[f"{base}.{name}"] = _rebase_refs(schema, rebase)
    return {"$ref": f"#/$defs/{base}"}


def call_schema(tools: Sequence[Mapping[str, Any]], args_key: str = "arguments") -> str:
    """`%json {...}` for a call to any of `tools`; each function's `parameters` schema is enforced (strict or not:
    the constraint is what makes a small model's calls parse), with no undeclared top-level arguments."""
    options = []
    defs: dict[str, Any] = {}
    for index, tool in enumerate(tools):
        fn = tool["function"]
        params: dict[str, Any] = dict(fn.get("parameters") or {"type": "object", "properties": {}})
        # A function's parameters are its signature: an argument it does not declare would fail the call, so
        # undeclared ones are closed off unless the schema itself allows them.
        params.setdefault("additionalProperties", False)
        args = _hoisted(params, index, defs) if _has_ref(params) else params
        options.append({"type": "object",
                        "properties": {"name": {"const": fn["name"]}, args_key: args},
                        "required": ["name", args_key], "additionalProperties": False})
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    if defs:
        schema["$defs"] = defs
    return "%json " + json.dumps(schema, ensure_ascii=False)


def args_rule(params: Mapping[str, Any], rules: Mapping[str, str], sep: str = '", "') -> str:
    """A function's arguments as one rule, from its parameters' schema and each declared argument's rule name
    (`rules`, in declaration order), `sep` (a grammar term, or "" for none) between them: the schema's required
    ones in its order, then each optional one at most once, in order (pythonic's and qwen3_coder's calls)."""
    required = [rules[n] for n in params.get("required", []) if n in rules]
    optional = [r for n, r in rules.items() if r not in required]
    glue = f" {sep} " if sep else " "
    if required:
        return " ".join([glue.join(required)] + [f"({sep} {o})?" if sep else f"{o}?" for o in optional])
    if not optional:
        return '""'
    # none required: whichever optional argument comes first, then the later ones, each at most once
    firsts = [" ".join([o] + [f"({sep} {later})?" if sep else f"{later}?" for later in optional[i + 1:]])
              for i, o in enumerate(optional)]
    return "(" + " | ".join(firsts) + ")?"


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

