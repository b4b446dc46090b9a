"""Scanning JSON text that may still be growing (a model's output, token by token).

The tool parsers need more than `json.loads`: while a call streams they must know where its `"name"` string ends
and where its `"arguments"` value starts, so the arguments can be sent as fragments of the model's own text.  The
fragments are slices of that text, and the complete call's arguments are the same slice, so a streamed call
reassembles to exactly the non-streamed one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_WS = " \t\r\n"
_SCALAR = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")


class Malformed(ValueError):
    """The text can never become valid JSON, whatever follows."""


def _not_json(name: str) -> Any:
    raise Malformed(f"{name} is not JSON")


def loads(text: str) -> Any:
    """`json.loads`, raising Malformed: the parsers catch only Malformed, and a model's invalid JSON (a trailing
    comma, a bad escape, a raw newline in a string) must become content, not an exception out of `parse`.  NaN and
    Infinity (which json.loads accepts) are not JSON either: a client's strict parser would refuse the arguments."""
    try:
        return json.loads(text, parse_constant=_not_json)
    except ValueError as e:
        raise Malformed(str(e)) from None


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def _string_end(text: str, pos: int) -> int | None:
    """`text[pos]` is '"': the index after the closing quote, or None while the string is open."""
    i = pos + 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def in_string(text: str, pos: int, stop: int) -> bool:
    """Whether `text[stop]` lies inside a JSON string, scanning from `pos` (outside any string)."""
    i = pos
    while i < stop:
        if text[i] == '"':
            end = _string_end(text, i)
            if end is None or end > stop:
                return True
            i = end
        else:
            i += 1
    return False


def value_end(text: str, pos: int, final: bool = False) -> int | None:
    """The end of the JSON value starting at `text[pos]` (no leading whitespace), or None while it is incomplete.
    Only the nesting and string syntax is checked here; `json.loads` checks the rest once the value is complete.
    A scalar at the very end of an unfinished text is incomplete (`12` may become `123`) unless `final`."""
    if pos >= len(text):
        return None
    c = text[pos]
    if c == '"':
        return _string_end(text, pos)
    if c in "{[":
        stack = [c]
        i = pos + 1
        while i < len(text):
            c = text[i]
            if c == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                stack.append(c)
            elif c in "}]":
                if (stack[-1] == "{") != (c == "}"):
                    raise Malformed(f"mismatched {c!r} at {i}")
                stack.pop()
                if not stack:
                    return i + 1
            i += 1
        return None
    m = _SCALAR.match(text, pos)
    if m is None:
        if any(w.startswith(text[pos:]) for w in ("true", "false", "null", "-")) and not final:
            return None
        raise Malformed(f"unexpected {c!r} at {pos}")
    if m.end() == len(text) and not final:
        return None
    return m.end()


@dataclass(slots=True)
class Member:
    key: str
    start: int  # where the value starts in the text
    end: int | None  # where it ends; None while it is still being written


def object_members(text: str, pos: int) -> tuple[list[Member], int | None]:
    """The members of the object whose '{' is at `text[pos]`, as far as the text goes: (members, end), `end` the
    index after the closing brace or None while the object is open.  The last member may be incomplete."""
    if pos >= len(text) or text[pos] != "{":
        raise Malformed("expected '{'")
    members: list[Member] = []
    i = skip_ws(text, pos + 1)
    if i < len(text) and text[i] == "}":
        return members, i + 1
    while i < len(text):
        if text[i] != '"':
            raise Malformed(f"expected a key at {i}")
        kend = _string_end(text, i)
        if kend is None:
            return members, None
        key = loads(text[i:kend])
        i = skip_ws(text, kend)
        if i >= len(text):
            return members, None
        if text[i] != ":":
            raise Malformed(f"expected ':' at {i}")
        i = skip_ws(text, i + 1)
        if i >= len(text):
            return members, None
        end = value_end(text, i)
        members.append(Member(key, i, end))
        if end is None:
            return members, None
        i = skip_ws(text, end)
        if i >= len(text):
            return members, None
        if text[i] == "}":
            return members, i + 1
        if text[i] != ",":
            raise Malformed(f"expected ',' or '}}' at {i}")
        i = skip_ws(text, i + 1)
    return members, None

