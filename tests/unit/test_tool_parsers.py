"""Tool-call parsers (hermes, llama3_json, mistral): realistic model outputs parse to the right content and calls,
a reply streamed one character at a time reassembles (the way the openai client does it) to exactly the
non-streamed parse, malformed output becomes content and never raises, the grammars accept what the parsers
parse and refuse what they must, and the registry resolves names and templates."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

import pytest

from tokenspout.tool_parsers import (
    TOOL_PARSERS,
    ToolCallStream,
    ToolParser,
    resolve_tool_parser,
    template_renders_tools,
)
from tokenspout.tool_parsers.base import ParsedCall, assemble, call_from_object, held_back
from tokenspout.tool_parsers.hermes import HermesToolParser
from tokenspout.tool_parsers.json_scan import Malformed, in_string, loads, object_members, value_end
from tokenspout.tool_parsers.llama3_json import Llama3JsonToolParser
from tokenspout.tool_parsers.mistral import MistralToolParser

PARSER_NAMES = ("hermes", "llama3_json", "mistral")
# What must never leak into streamed content while the text may still grow into a start marker.
PARTIAL_MARKERS = {
    "hermes": ("<tool_c", "<tool_call"),
    "llama3_json": ("<|python", "<|python_tag"),
    "mistral": ("[TOOL_CA", "[TOOL_CALLS"),
    "pythonic": ("<|python_st", "<|python_start"),
    "qwen3_coder": ("<tool_c", "<tool_call"),
}


# ----------------------------------------------------------------------------------------------------------------
# Helpers: the non-streamed parse, and a stream reassembled the way the openai client reassembles it
# ----------------------------------------------------------------------------------------------------------------


def parse_final(name: str, text: str) -> tuple[str, list[tuple[str, str]]]:
    parse = TOOL_PARSERS[name]().parse(text, True)
    return parse.content, [(c.name, c.arguments) for c in parse.tool_calls()]


@dataclass
class Reassembled:
    """What a client holds after the stream: content, and the calls by index (id, name, arguments text)."""

    content: str = ""
    ids: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)
    first_arguments: list[str] = field(default_factory=list)  # function.arguments of each call's first delta

    def add(self, content: str, tool_calls: list[dict[str, Any]]) -> None:
        self.content += content
        for tc in tool_calls:
            i = tc["index"]
            if i == len(self.ids):  # a new call: OpenAI's first delta shape
                assert set(tc) == {"index", "id", "type", "function"}, tc
                assert tc["type"] == "function" and isinstance(tc["id"], str) and tc["id"]
                assert set(tc["function"]) == {"name", "arguments"}, tc
                assert isinstance(tc["function"]["name"], str) and tc["function"]["name"]
                assert isinstance(tc["function"]["arguments"], str)
                self.ids.append(tc["id"])
                self.names.append(tc["function"]["name"])
                self.arguments.append(tc["function"]["arguments"])
                self.first_arguments.append(tc["function"]["arguments"])
            else:  # a later delta: index and an arguments fragment only
                assert 0 <= i < len(self.ids), f"delta for a call never opened: {tc}"
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}, tc
                assert isinstance(tc["function"]["arguments"], str) and tc["function"]["arguments"], tc
                self.arguments[i] += tc["function"]["arguments"]

    @property
    def calls(self) -> list[tuple[str, str]]:
        return list(zip(self.names, self.arguments))


def stream_chars(name: str, text: str, *, check_markers: bool = True) -> Reassembled:
    """`text` streamed one character at a time through ToolCallStream, then once more with final=True.  Checks on
    the way that content only ever grows by appending (in the parser itself, not just in what the stream lets
    through) and that no partial start marker is ever shown as content."""
    parser = TOOL_PARSERS[name]()
    parse = parser.parse
    parsed: list[str] = []  # the content of every parse the stream makes

    def recording_parse(text: str, final: bool):
        result = parse(text, final)
        parsed.append(result.content)
        return result

    parser.parse = recording_parse  # type: ignore[method-assign]
    stream = ToolCallStream(parser)
    out = Reassembled()
    previous = ""
    for i in range(len(text) + 1):
        out.add(*stream.update(text[:i], final=False))
        # the stream only sends content that extends what it sent; the parser must never need more than that
        assert parsed[-1].startswith(previous), f"content not append-only at {i}: {previous!r} -> {parsed[-1]!r}"
        previous = parsed[-1]
        assert out.content == stream.content
        if check_markers:
            for partial in PARTIAL_MARKERS[name]:
                assert partial not in out.content, f"partial marker {partial!r} leaked at {i}: {out.content!r}"
    out.add(*stream.update(text, final=True))
    assert stream.num_calls == len(out.ids)
    return out


# ----------------------------------------------------------------------------------------------------------------
# 1/2. Recorded realistic outputs: non-streamed parse, and the char-by-char stream equal to it
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    parser: str
    id: str
    text: str
    content: str
    calls: list[tuple[str, dict[str, Any]]]


CASES = [
    # --- hermes: Qwen2.5 / Qwen3 / Hermes 2 Pro write one <tool_call> block per call, JSON with ": " and ", " ---
    Case("hermes", "qwen25-single",
         '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "San Francisco, CA", '
         '"unit": "fahrenheit"}}\n</tool_call>',
         "", [("get_current_weather", {"location": "San Francisco, CA", "unit": "fahrenheit"})]),
    Case("hermes", "qwen25-parallel",
         '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
         '</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": '
         '"San Francisco, CA, USA", "date": "2024-10-01", "unit": "celsius"}}\n</tool_call>',
         "", [("get_current_temperature", {"location": "San Francisco, CA, USA"}),
              ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01",
                                        "unit": "celsius"})]),
    Case("hermes", "qwen25-content-first",
         "I'll convert that amount for you using today's rate.\n\n<tool_call>\n"
         '{"name": "convert_currency", "arguments": {"amount": 150.75, "from": "EUR", "to": "JPY"}}\n</tool_call>',
         "I'll convert that amount for you using today's rate.",
         [("convert_currency", {"amount": 150.75, "from": "EUR", "to": "JPY"})]),
    Case("hermes", "unicode-nested-escapes",
         '<tool_call>\n{"name": "send_message", "arguments": {"recipient": "José Müller", "text": "He said '
         '\\"ciao\\" — 你好 👋\\nBye", "options": {"priority": "high", "tags": ["work", "ürgent"], "retry": '
         '{"max": 3, "backoff": 1.5e0}}, "silent": false, "thread": null, "path": "C:\\\\Users\\\\jm"}}\n'
         '</tool_call>',
         "", [("send_message", {"recipient": "José Müller", "text": 'He said "ciao" — 你好 👋\nBye',
                                "options": {"priority": "high", "tags": ["work", "ürgent"],
                                            "retry": {"max": 3, "backoff": 1.5}},
                                "silent": False, "thread": None, "path": "C:\\Users\\jm"})]),
    Case("hermes", "hermes2pro-arguments-first",  # Hermes 2 Pro writes the arguments before the name
         '<tool_call>\n{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n</tool_call>',
         "", [("get_stock_fundamentals", {"symbol": "TSLA"})]),
    Case("hermes", "qwen3-after-thinking-answer",  # the answer part of a Qwen3 reply (reasoning split off)
         "\n\nLet me search for both.\n<tool_call>\n"
         '{"name": "web_search", "arguments": {"query": "tokyo population 2024", "max_results": 3}}\n</tool_call>\n'
         '<tool_call>\n{"name": "web_search", "arguments": {"query": "\\u6771\\u4eac \\u4eba\\u53e3"}}\n</tool_call>',
         "\n\nLet me search for both.",  # only the whitespace next to a call is dropped
         [("web_search", {"query": "tokyo population 2024", "max_results": 3}),
          ("web_search", {"query": "東京 人口"})]),
    Case("hermes", "no-arguments-and-text-around",
         'Checking the clock.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
         "I'll report back once I have it.",
         "Checking the clock.\nI'll report back once I have it.", [("get_time", {})]),
    Case("hermes", "marker-text-inside-an-argument",  # "</tool_call>" inside a JSON string is not the end marker
         "Saving the notes.\n<tool_call>\n"
         '{"name": "write_file", "arguments": {"path": "notes.md", "content": "Wrap calls in <tool_call> ... '
         '</tool_call> tags.\\n"}}\n</tool_call>',
         "Saving the notes.",
         [("write_file", {"path": "notes.md", "content": "Wrap calls in <tool_call> ... </tool_call> tags.\n"})]),
    Case("hermes", "plain-answer",
         "The tallest mountain is Everest (8,849 m). Comparisons: a < b, x > y, and [brackets] {braces}.",
         "The tallest mountain is Everest (8,849 m). Comparisons: a < b, x > y, and [brackets] {braces}.", []),
    # --- llama3_json: Llama 3.1/3.2/3.3 write the call as the whole reply, "parameters", optional python tag ---
    Case("llama3_json", "llama31-single",
         '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}',
         "", [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})]),
    Case("llama3_json", "llama31-python-tag",
         '<|python_tag|>{"name": "get_current_conditions", "parameters": {"location": "Menlo Park, CA"}}',
         "", [("get_current_conditions", {"location": "Menlo Park, CA"})]),
    Case("llama3_json", "llama32-parallel-semicolon",
         '{"name": "get_weather", "parameters": {"city": "Tokyo"}}; '
         '{"name": "get_weather", "parameters": {"city": "Zürich", "days": 3}}',
         "", [("get_weather", {"city": "Tokyo"}), ("get_weather", {"city": "Zürich", "days": 3})]),
    Case("llama3_json", "llama33-type-key-nested",
         '{"type": "function", "name": "search_flights", "parameters": {"origin": "SFO", "destination": "NRT", '
         '"passengers": {"adults": 2, "children": [7, 9]}, "note": "window seat, \\"quiet\\" area", '
         '"max_price": -1, "flexible": true}}',
         "", [("search_flights", {"origin": "SFO", "destination": "NRT", "passengers": {"adults": 2,
                                                                                  "children": [7, 9]},
                                  "note": 'window seat, "quiet" area', "max_price": -1, "flexible": True})]),
    Case("llama3_json", "leading-newline-and-no-space-semicolon",
         '\n{"name": "lookup", "parameters": {"term": "Straße"}};{"name": "lookup", "parameters": {}}',
         "", [("lookup", {"term": "Straße"}), ("lookup", {})]),
    Case("llama3_json", "plain-answer",
         "The capital of France is Paris. It has about 2.1 million inhabitants {in the city proper}.",
         "The capital of France is Paris. It has about 2.1 million inhabitants {in the city proper}.", []),
    # --- mistral: [TOOL_CALLS] then a JSON list (v0.3 writes a space after the marker) ---
    Case("mistral", "mistral7b-v03-single",
         '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
         '"format": "celsius"}}]',
         "", [("get_current_weather", {"location": "Paris, France", "format": "celsius"})]),
    Case("mistral", "nemo-parallel",
         '[TOOL_CALLS][{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": '
         '"celsius"}}, {"name": "get_current_weather", "arguments": {"location": "Tōkyō, Japan", "format": '
         '"celsius"}}]',
         "", [("get_current_weather", {"location": "Paris, France", "format": "celsius"}),
              ("get_current_weather", {"location": "Tōkyō, Japan", "format": "celsius"})]),
    Case("mistral", "content-first-with-ids",
         'Let me check both accounts.[TOOL_CALLS][{"name": "get_balance", "arguments": {"account": "savings"}, '
         '"id": "a1B2c3D4e"}, {"name": "get_balance", "arguments": {"account": "checking \\"joint\\""}, '
         '"id": "Zz9Yy8Xx7"}]',
         "Let me check both accounts.",
         [("get_balance", {"account": "savings"}), ("get_balance", {"account": 'checking "joint"'})]),
    Case("mistral", "nested-unicode",
         '[TOOL_CALLS] [{"name": "create_event", "arguments": {"title": "Réunion d\'équipe 🚀", "attendees": '
         '[{"name": "Zoë", "optional": false}, {"name": "Łukasz", "optional": true}], "when": {"start": '
         '"2024-11-05T09:30:00+01:00", "duration_min": 45}, "notes": "Bring the \\"Q3\\" deck\\tplease"}}]',
         "", [("create_event", {"title": "Réunion d'équipe 🚀",
                                "attendees": [{"name": "Zoë", "optional": False},
                                              {"name": "Łukasz", "optional": True}],
                                "when": {"start": "2024-11-05T09:30:00+01:00", "duration_min": 45},
                                "notes": 'Bring the "Q3" deck\tplease'})]),
    Case("mistral", "single-object-without-list",
         '[TOOL_CALLS] {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}',
         "", [("get_time", {"tz": "Europe/Paris"})]),
    Case("mistral", "plain-answer",
         "Paris is the capital of France. Use [square brackets] for lists, e.g. [1, 2].",
         "Paris is the capital of France. Use [square brackets] for lists, e.g. [1, 2].", []),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.parser}-{c.id}")
def test_recorded_output_parses(case: Case):
    content, calls = parse_final(case.parser, case.text)
    assert content == case.content
    assert [name for name, _ in calls] == [name for name, _ in case.calls]
    for (_, arguments), (_, expected) in zip(calls, case.calls):
        assert json.loads(arguments) == expected
    if case.calls:  # the arguments are the model's own text, not a re-serialisation
        for _, arguments in calls:
            assert arguments in case.text or arguments == "{}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.parser}-{c.id}")
def test_recorded_output_streams_to_the_same_parse(case: Case):
    out = stream_chars(case.parser, case.text)
    content, calls = parse_final(case.parser, case.text)
    assert out.content == content
    assert out.calls == calls
    assert len(set(out.ids)) == len(out.ids)
    for call_id in out.ids:
        if case.parser == "mistral":
            assert re.fullmatch(r"[A-Za-z0-9]{9}", call_id)
        else:
            assert call_id.startswith("chatcmpl-tool-")


@pytest.mark.parametrize("name", PARSER_NAMES)
def test_name_streams_before_the_arguments(name):
    """A call whose name comes first is announced (arguments "") as soon as the name is complete, and its
    arguments then arrive as fragments while they are being written."""
    case = next(c for c in CASES if c.parser == name and len(c.calls) == 2)
    parser = TOOL_PARSERS[name]()
    stream = ToolCallStream(parser)
    out = Reassembled()
    fragments = 0
    for i in range(len(case.text) + 1):
        before = len(out.ids)
        content, deltas = stream.update(case.text[:i], final=False)
        out.add(content, deltas)
        fragments += sum("id" not in d for d in deltas)
        if len(out.ids) > before:
            # announced once the name's closing quote is written, while the arguments are still to come
            assert case.text[:i].endswith('"' + out.names[-1] + '"')
    assert out.first_arguments == ["", ""]
    assert fragments > 2  # the arguments streamed in pieces, not in one go at the end
    out.add(*stream.update(case.text, final=True))
    assert out.calls == parse_final(name, case.text)[1]


def test_arguments_first_call_is_sent_whole_once_named():
    """Hermes 2 Pro's arguments-before-name: nothing can be announced before the name, then the call goes out in
    one first delta carrying all of its arguments."""
    case = next(c for c in CASES if c.id == "hermes2pro-arguments-first")
    out = stream_chars("hermes", case.text)
    assert out.first_arguments == ['{"symbol": "TSLA"}']


@pytest.mark.parametrize("name", PARSER_NAMES)
def test_partial_marker_is_held_back_then_released(name):
    """A tail that may grow into the start marker is held back while streaming; if the reply ends there, the
    final parse gives it back as content."""
    marker = {"hermes": "<tool_call>", "llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}[name]
    prefix = "" if name == "llama3_json" else "Let me see "
    for n in range(1, len(marker)):
        text = prefix + marker[:n]
        parser = TOOL_PARSERS[name]()
        assert parser.parse(text, False).content == prefix.rstrip()
        assert parser.parse(text, True).content == text
        assert parser.parse(text, True).calls == []
        assert stream_chars(name, text, check_markers=False).content == text


def test_llama3_json_brace_answer_is_content_at_the_end():
    """llama3_json has no marker: a reply opening with '{' may be a call and is held back while it streams; if
    it is not a call it comes out whole as content at the end."""
    text = '{"answer": 42, "unit": "m"}'
    parser = Llama3JsonToolParser()
    assert parser.parse(text, False).content == ""
    assert parser.parse(text, True).content == text and parser.parse(text, True).calls == []
    out = stream_chars("llama3_json", text)
    assert out.content == text and out.calls == []


@pytest.mark.parametrize("name", PARSER_NAMES)
def test_text_after_a_complete_call(name):
    """Text the model writes after a complete call is content; the call stands (streamed and not)."""
    text = {
        "hermes": '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\nAnything else?',
        "llama3_json": '{"name": "a", "parameters": {"x": 1}}\n\nAnything else?',
        "mistral": '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}]\nAnything else?',
    }[name]
    assert parse_final(name, text) == ("Anything else?", [("a", '{"x": 1}')])
    out = stream_chars(name, text)
    assert (out.content, out.calls) == parse_final(name, text)


def test_hermes_arguments_written_as_a_json_string():
    text = '<tool_call>\n{"name": "f", "arguments": "{\\"q\\": \\"x y\\"}"}\n</tool_call>'
    assert parse_final("hermes", text) == ("", [("f", '{"q": "x y"}')])
    out = stream_chars("hermes", text)
    assert (out.content, out.calls) == parse_final("hermes", text)


def test_hermes_block_without_arguments_key():
    assert parse_final("hermes", '<tool_call>\n{"name": "ping"}\n</tool_call>') == ("", [("ping", "{}")])


def test_hermes_complete_call_missing_end_marker_still_counts():
    """max_tokens (or EOS) right after the call's JSON: the JSON is complete, so the call is kept."""
    text = 'Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": [1, 2]}}'
    assert parse_final("hermes", text) == ("Sure.", [("a", '{"x": [1, 2]}')])
    out = stream_chars("hermes", text)
    assert (out.content, out.calls) == parse_final("hermes", text)


# ----------------------------------------------------------------------------------------------------------------
# Generated valid outputs (seeded): stream == non-streamed == what was written
# ----------------------------------------------------------------------------------------------------------------

_STRINGS = ["", "Paris", 'say "hi"', "a\\b", "line\nbreak", "日本語 ✓", "😀", "tab\t", "</tool_call>", "<tool_call>",
            "[TOOL_CALLS]", "<|python_tag|>", "</tool", "{not: json}", "[1, 2", "; {"]


def _value(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if depth < 2 and r < 0.15:
        return {rng.choice(["k", "ключ", "a b", 'q"t', "{"]): _value(rng, depth + 1) for _ in range(rng.randint(0, 2))}
    if depth < 2 and r < 0.3:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return rng.choice([0, -1, 3.25, 1e-7, 12345678901234567890, True, False, None, *_STRINGS])


def _dumps(rng: random.Random, value: Any) -> str:
    separators = rng.choice([(", ", ": "), (",", ":")])
    return json.dumps(value, separators=separators, ensure_ascii=rng.random() < 0.3)


def _generated(rng: random.Random, name: str) -> tuple[str, str, list[tuple[str, dict[str, Any]]]]:
    calls = [(rng.choice(["get_weather", "search", "f_1"]),
              {f"{rng.choice(['city', 'query', 'opts'])}{i}": _value(rng) for i in range(rng.randint(0, 4))})
             for _ in range(rng.randint(1, 3))]
    before = rng.choice(["", "Sure!", "Let me look that up.\n\n", "x < y [a] {b}", "Voilà — ", "Hmm, <tool or [TOOL"])
    if name == "hermes":
        after = rng.choice(["", "\n", "\nDone."])
        text = before + ("\n" if before else "") + "\n".join(
            f"<tool_call>\n{_dumps(rng, {'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls) + after
        content = "\n".join(p for p in (before.strip(), after.strip()) if p)
    elif name == "llama3_json":
        text = rng.choice(["", "<|python_tag|>"]) + rng.choice(["; ", ";"]).join(
            _dumps(rng, {"name": n, "parameters": a}) for n, a in calls)
        content = ""
    else:
        text = before + rng.choice(["", " "]) + "[TOOL_CALLS]" + rng.choice(["", " "]) + _dumps(
            rng, [{"name": n, "arguments": a} for n, a in calls])
        content = before.strip()
    return text, content, calls


@pytest.mark.parametrize("name", PARSER_NAMES)
def test_generated_outputs_stream_and_parse(name):
    rng = random.Random(f"tool-parsers-{name}")
    for _ in range(25):
        text, content, calls = _generated(rng, name)
        got_content, got_calls = parse_final(name, text)
        assert got_content == content, text
        assert [(n, json.loads(a)) for n, a in got_calls] == calls, text
        out = stream_chars(name, text, check_markers=False)
        assert (out.content, out.calls) == (got_content, got_calls), text


# ----------------------------------------------------------------------------------------------------------------
# 3. Malformed outputs: the final parse gives the text back as content, no calls, never raises
# ----------------------------------------------------------------------------------------------------------------

MALFORMED = {
    "hermes": [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",}}\n</tool_call>',  # trailing comma
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',  # bad JSON
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\nris"}}\n</tool_call>',  # raw newline
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "\\q"}}\n</tool_call>',  # bad escape
        '<tool_call>\n{"name": "get_weather", "arguments": {"x": NaN}}\n</tool_call>',  # not JSON
        '<tool_call>\n{"name": "get_weather", "arguments": {"x": [1, Infinity]}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',  # missing brace
        "<tool_call>\n",  # cut off right after the marker
        "<tool_call>",
        '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # missing name
        '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>',  # empty name
        '<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>',  # name not a string
        '<tool_call>\n{"name": "get_weather", "arguments": ["Paris"]}\n</tool_call>',  # arguments not an object
        '<tool_call>\n{"name": "get_weather", "arguments": 3}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',  # a string, but not JSON
        '<tool_call>\n{"name": "get_weather", "arguments": "[1]"}\n</tool_call>',  # a string holding a non-object
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}} trailing words\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}}\n</tool_call>',  # garbage after
        '<tool_call>\nget_weather(city="Paris")\n</tool_call>',  # not JSON at all
        '<tool_call>\n["get_weather", {"city": "Paris"}]\n</tool_call>',  # not an object
        "<tool_call>\n</tool_call>",  # empty block
    ],
    "llama3_json": [
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris",}}',  # trailing comma
        '{"name": "get_weather", "parameters": {"city": Paris}}',
        '{"name": "get_weather", "parameters": {"x": -Infinity}}',
        '{"parameters": {"city": "Paris"}}',  # missing name
        '{"name": null, "parameters": {}}',
        '{"name": "get_weather", "parameters": "Paris"}',  # arguments not an object
        '{"name": "get_weather", "parameters": [1, 2]}',
        '{"name": "get_weather", "parameters": false}',
        '{"name": "get_weather" "parameters": {}}',  # missing comma
        '{"name": "get_weather", "parameters": {"city": "Paris"}]',  # mismatched bracket
        '{"city": "Paris"}',  # a JSON answer, not a call
        "{not json at all",
        "{",
        "<|python_tag|>",
    ],
    "mistral": [
        "[TOOL_CALLS]",  # nothing after the marker
        "[TOOL_CALLS] ",
        "[TOOL_CALLS] get_weather(city='Paris')",  # not JSON
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ]',  # trailing comma in the list
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris",}}]',  # trailing comma in an object
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": Paris}}]',
        '[TOOL_CALLS][{"arguments": {"city": "Paris"}}]',  # missing name
        '[TOOL_CALLS][{"name": "get_weather", "arguments": [1, 2]}]',  # arguments not an object
        '[TOOL_CALLS][{"name": "get_weather", "arguments": "Paris"}]',
        '[TOOL_CALLS][{"name": "a", "arguments": {}} {"name": "b", "arguments": {}}]',  # missing comma
        '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {]',  # second call broken
        '[TOOL_CALLS]["get_weather"]',  # list of something else
        'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"x": 1e}}]',
    ],
}


@pytest.mark.parametrize("name,text", [(n, t) for n, texts in MALFORMED.items() for t in texts])
def test_malformed_output_is_content(name, text):
    parser = TOOL_PARSERS[name]()
    parse = parser.parse(text, True)
    assert parse.content == text
    assert parse.calls == [] and parse.tool_calls() == []
    for i in range(len(text) + 1):  # no prefix raises either, streaming or final
        parser.parse(text[:i], False)
        parser.parse(text[:i], True)
    # Streamed: the content reassembles to the final content (a call already announced while the text still
    # looked like one cannot be taken back; that is ToolCallStream's documented limit, and the grammar's job).
    out = stream_chars(name, text, check_markers=False)
    assert out.content == text


def test_hermes_malformed_block_between_good_ones():
    """A broken block is content in place, as written (no newline added inside it); the good blocks are calls."""
    bad = '<tool_call>\n{"name": "b", "arguments": {"x": 1,}}\n</tool_call>'
    text = ('Two lookups.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n' + bad
            + '\n<tool_call>\n{"name": "c", "arguments": {"y": "z"}}\n</tool_call>')
    assert parse_final("hermes", text) == ("Two lookups.\n" + bad, [("a", "{}"), ("c", '{"y": "z"}')])
    text = "Let me check.\n" + bad + '\n<tool_call>\n{"name": "c", "arguments": {}}\n</tool_call>'
    assert parse_final("hermes", text) == ("Let me check.\n" + bad, [("c", "{}")])
    out = stream_chars("hermes", text, check_markers=False)
    assert out.content == "Let me check.\n" + bad


CUT = [  # (parser, reply cut by max_tokens, content, (name, arguments so far))
    ("hermes", 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "Checking.",
     ("get_weather", '{"city": "Par')),
    ("hermes", '<tool_call>\n{"name": "get_weather", "argu', "", ("get_weather", "")),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}', "", ("get_weather", '{"city": "Paris"}')),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par', "", ("get_weather", '{"city": "Par')),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}', "",
     ("get_weather", '{"city": "Paris"}')),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}', "",
     ("get_weather", '{"city": "Paris"}')),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}},', "",
     ("get_weather", '{"city": "Paris"}')),
]


@pytest.mark.parametrize("name,text,content,call", CUT)
def test_a_call_cut_by_the_end_of_the_reply_keeps_what_was_written(name, text, content, call):
    """As OpenAI: a call max_tokens cuts is returned with its arguments as far as they go (finish_reason length),
    which is also exactly what a stream has already sent of it, so streamed == non-streamed."""
    parse = TOOL_PARSERS[name]().parse(text, True)
    assert parse.content == content
    assert [(c.name, c.arguments) for c in parse.tool_calls()] == [call]
    out = stream_chars(name, text, check_markers=False)
    assert out.content == content and out.calls == [call]


@pytest.mark.parametrize("rest", ['{"parameters": {}}'])
def test_llama3_json_good_call_then_a_broken_one(rest):
    """Calls are read one at a time: a good first call stands, what is left from the broken one is content."""
    text = '{"name": "get_weather", "parameters": {}}; ' + rest
    assert parse_final("llama3_json", text) == (rest, [("get_weather", "{}")])
    out = stream_chars("llama3_json", text, check_markers=False)
    assert out.content == rest and out.calls[0] == ("get_weather", "{}")


def _mutations(rng: random.Random, text: str, n: int) -> list[str]:
    pieces = list('{}[]",:;\\ \n01tfn-.eEu') + ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>"]
    out = []
    for _ in range(n):
        chars = list(text)
        for _ in range(rng.randint(1, 3)):
            k = rng.randrange(len(chars) + 1)
            op = rng.random()
            if op < 0.4 and chars:
                del chars[min(k, len(chars) - 1)]
            elif op < 0.8:
                chars.insert(k, rng.choice(pieces))
            else:
                chars = chars[:k]
        out.append("".join(chars))
    return out


@pytest.mark.parametrize("name", PARSER_NAMES)
def test_mutated_outputs_never_raise(name):
    """Seeded random edits of a realistic reply: every prefix parses (as it streams) without raising, every call
    returned has JSON-object arguments, the streamed content reassembles to the final content."""
    rng = random.Random(f"mutate-{name}")
    base = next(c for c in CASES if c.parser == name and len(c.calls) == 2).text
    for text in _mutations(rng, base, 30):
        parse = TOOL_PARSERS[name]().parse(text, True)
        for call in parse.tool_calls():
            if call.complete:  # (a call cut by the end of the reply keeps its arguments as far as they go)
                assert isinstance(json.loads(call.arguments), dict)
            assert call.name
        out = stream_chars(name, text, check_markers=False)
        assert out.content == parse.content, text


# ----------------------------------------------------------------------------------------------------------------
# The shared pieces: JSON scanning, call objects, hold-back, assembly
# ----------------------------------------------------------------------------------------------------------------


def test_value_end():
    assert value_end('{"a": [1, {"b": "}"}]} tail', 0) == 22
    assert value_end('"a\\"b" x', 0) == 6
    assert value_end('{"a": "unterminated', 0) is None
    assert value_end("[1, 2", 0) is None
    assert value_end("123", 0) is None and value_end("123", 0, final=True) == 3
    assert value_end("123,", 0) == 3
    assert value_end("tr", 0) is None
    assert value_end("true]", 0) == 4
    with pytest.raises(Malformed):
        value_end("[1}", 0)
    with pytest.raises(Malformed):
        value_end("xyz", 0)
    with pytest.raises(Malformed):
        value_end("tr", 0, final=True)


def test_object_members_and_in_string():
    members, end = object_members('{"name": "f", "arguments": {"x": 1}}', 0)
    assert end == 36 and [m.key for m in members] == ["name", "arguments"]
    assert members[1].start == 27 and members[1].end == 35
    members, end = object_members('{"name": "f", "argu', 0)
    assert end is None and [m.key for m in members] == ["name"]
    members, end = object_members('{"name": "f", "arguments": {"x": ', 0)
    assert end is None and members[-1].key == "arguments" and members[-1].end is None
    with pytest.raises(Malformed):
        object_members('{"a" 1}', 0)
    with pytest.raises(Malformed):
        object_members('{"a\\q": 1}', 0)  # an invalid key string is Malformed, not a bare JSONDecodeError
    text = '{"s": "a</x>b", "t": 1}</x>'
    assert in_string(text, 0, text.index("</x>"))
    assert not in_string(text, 0, text.rindex("</x>"))


def test_loads_is_strict():
    assert loads('{"a": [1, 2.5, null]}') == {"a": [1, 2.5, None]}
    for bad in ("[NaN]", '{"a": Infinity}', "[-Infinity]", "{'a': 1}", '{"a": 1,}'):
        with pytest.raises(Malformed):
            loads(bad)


def test_call_from_object():
    call, end = call_from_object('{"name": "f", "arguments": {"x": 1}} rest', 0, False)
    assert call == ParsedCall("f", '{"x": 1}', True) and end == 36
    call, end = call_from_object('{"name": "f", "arguments": {"x": 1', 0, False)
    assert call == ParsedCall("f", '{"x": 1', False) and end is None
    call, end = call_from_object('{"name": "f", "arguments": "{\\"x', 0, False)
    assert call == ParsedCall("f", "", False)  # a string's arguments go out once complete
    call, end = call_from_object('{"name": "f"', 0, False)
    assert call == ParsedCall("f", "", False)
    call, end = call_from_object('{"nam', 0, False)
    assert call == ParsedCall(None, "", False)
    with pytest.raises(Malformed):
        call_from_object('{"name": "f", "arguments": {"x": 1', 0, True)
    with pytest.raises(Malformed):
        call_from_object('{"name": "f", "arguments": {"x": 1,}}', 0, False)


def test_held_back():
    assert held_back("Hello <tool_c", ("<tool_call>",)) == "Hello "
    assert held_back("Hello <tool_call>", ("<tool_call>",)) == "Hello <tool_call>"  # a whole marker is not held
    assert held_back("a <b", ("<tool_call>",)) == "a <b"
    assert held_back("x [TOOL", ("[TOOL_CALLS]", "<tool_call>")) == "x "
    assert held_back("abc", ()) == "abc"


def test_assemble():
    call = ParsedCall("f", "{}", True)
    assert assemble(["  Hi there  ", call, "\n\n after \n", call, "  "], False, True, ()).content == \
        "  Hi there\nafter"
    assert assemble(["text <tool_c"], True, False, ("<tool_call>",)).content == "text"
    assert assemble(["text <tool_c"], True, True, ("<tool_call>",)).content == "text <tool_c"
    # adjacent text items are one run of text (no newline inserted between them)
    assert assemble(["a\n", "<bad block>", "\n", call], False, True, ()).content == "a\n<bad block>"


# ----------------------------------------------------------------------------------------------------------------
# 4. Grammars: compile with llguidance, accept the canonical compact output, refuse what they must
# ----------------------------------------------------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}
TIME = {"name": "get_time", "arguments": {}}


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer):
    """llguidance's view of the default model's tokenizer (SmolLM2, from conftest's session `tokenizer`)."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer)


def _compact(call: dict[str, Any], args_key: str = "arguments") -> str:
    return json.dumps({"name": call["name"], args_key: call["arguments"]}, separators=(",", ":"),
                      ensure_ascii=False)


def _canonical(name: str, calls: list[dict[str, Any]]) -> str:
    """The compact output each grammar is built to produce."""
    if name == "hermes":
        return "\n".join(f"<tool_call>\n{_compact(c)}\n</tool_call>" for c in calls)
    if name == "llama3_json":
        return "; ".join(_compact(c, "parameters") for c in calls)
    return "[TOOL_CALLS][" + ",".join(_compact(c) for c in calls) + "]"


def _accepts(ll_tokenizer, tokenizer, grammar: str, text: str | list[int]) -> bool:
    import llguidance

    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.grammar_from("grammar", grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = tokenizer.encode(text, add_special_tokens=False) if isinstance(text, str) else text
    consumed = matcher.try_consume_tokens(ids)
    return consumed == len(ids) and matcher.is_accepting()


MODES = [(required, parallel) for required in (True, False) for parallel in (True, False)]


@pytest.mark.parametrize("required,parallel", MODES, ids=lambda v: str(v))
@pytest.mark.parametrize("name", PARSER_NAMES)
def test_grammar_accepts_canonical_calls(ll_tokenizer, tokenizer, name, required, parallel):
    import llguidance

    grammar = TOOL_PARSERS[name]().grammar(TOOLS, required=required, parallel=parallel, special_token_ids={})
    assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("grammar", grammar)) == ""
    one, two = _canonical(name, [WEATHER]), _canonical(name, [WEATHER, TIME])
    assert _accepts(ll_tokenizer, tokenizer, grammar, one)
    assert _accepts(ll_tokenizer, tokenizer, grammar, _canonical(name, [TIME]))
    assert _accepts(ll_tokenizer, tokenizer, grammar, two) == parallel  # a second call only when parallel
    # what the grammar produces, the parser parses back to the same calls
    calls = TOOL_PARSERS[name]().parse(two, True).tool_calls()
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", WEATHER["arguments"]),
                                                                   ("get_time", {})]


@pytest.mark.parametrize("required,parallel", MODES, ids=lambda v: str(v))
@pytest.mark.parametrize("name", PARSER_NAMES)
def test_grammar_refuses_bad_calls(ll_tokenizer, tokenizer, name, required, parallel):
    grammar = TOOL_PARSERS[name]().grammar(TOOLS, required=required, parallel=parallel, special_token_ids={})
    one = _canonical(name, [WEATHER])
    refused = [
        one.replace("get_weather", "get_wether"),  # not one of the tools
        one.replace('"Paris"', "42"),  # city must be a string
        one.replace('"days":2', '"days":"two"'),  # days must be an integer
        _canonical(name, [{"name": "get_weather", "arguments": {"days": 2}}]),  # city is required
        one.replace('"city":"Paris"', '"city": "Paris"'),  # compact JSON only
    ]
    for text in refused:
        assert not _accepts(ll_tokenizer, tokenizer, grammar, text), text


@pytest.mark.parametrize("name", PARSER_NAMES)
def test_grammar_free_text_only_in_auto_mode(ll_tokenizer, tokenizer, name):
    answer = "The weather in Paris is sunny, 21 °C."
    for parallel in (True, False):
        required = TOOL_PARSERS[name]().grammar(TOOLS, required=True, parallel=parallel, special_token_ids={})
        auto = TOOL_PARSERS[name]().grammar(TOOLS, required=False, parallel=parallel, special_token_ids={})
        assert not _accepts(ll_tokenizer, tokenizer, required, answer)
        assert _accepts(ll_tokenizer, tokenizer, auto, answer)
        assert _accepts(ll_tokenizer, tokenizer, auto, "")  # an empty answer is an answer


@pytest.mark.parametrize("name", ["hermes", "mistral"])
def test_auto_grammar_constrains_after_the_marker(ll_tokenizer, tokenizer, name):
    grammar = TOOL_PARSERS[name]().grammar(TOOLS, required=False, parallel=True, special_token_ids={})
    marker = {"hermes": "<tool_call>\n", "mistral": "[TOOL_CALLS]["}[name]
    assert _accepts(ll_tokenizer, tokenizer, grammar, "Let me check. " + _canonical(name, [WEATHER, TIME]))
    assert not _accepts(ll_tokenizer, tokenizer, grammar, "Let me check. " + marker + '{"nme":"x"}')
    assert not _accepts(ll_tokenizer, tokenizer, grammar, "Let me check. " + marker + "get_weather(Paris)")
    assert not _accepts(ll_tokenizer, tokenizer, grammar,
                        "Let me check. " + _canonical(name, [WEATHER]).replace("get_weather", "rm_rf"))
    # after the calls, nothing but whitespace
    assert _accepts(ll_tokenizer, tokenizer, grammar, _canonical(name, [WEATHER]) + "\n")
    assert not _accepts(ll_tokenizer, tokenizer, grammar, _canonical(name, [WEATHER]) + "\nDone.")


def test_llama3_auto_grammar_a_brace_opens_a_call(ll_tokenizer, tokenizer):
    grammar = Llama3JsonToolParser().grammar(TOOLS, required=False, parallel=True, special_token_ids={})
    assert _accepts(ll_tokenizer, tokenizer, grammar, "Sure, {this} is just text.")
    assert not _accepts(ll_tokenizer, tokenizer, grammar, '{"answer": 42}')  # '{' opens a call: must be one
    assert not _accepts(ll_tokenizer, tokenizer, grammar, _canonical("llama3_json", [WEATHER]).replace(
        "parameters", "arguments"))  # Llama's key is "parameters"
    assert _accepts(ll_tokenizer, tokenizer, grammar, _canonical("llama3_json", [WEATHER]) + "\n")


def test_mistral_grammar_with_the_marker_as_a_special_token(ll_tokenizer, tokenizer):
    """Where [TOOL_CALLS] is one special token the grammar names it by id (SmolLM2 has no such token: we lend it
    <|im_start|>'s id for the test)."""
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    ids = {"[TOOL_CALLS]": special}
    body = tokenizer.encode(_canonical("mistral", [WEATHER, TIME])[len("[TOOL_CALLS]"):], add_special_tokens=False)
    required = MistralToolParser().grammar(TOOLS, required=True, parallel=True, special_token_ids=ids)
    assert f"<[{special}]>" in required
    assert _accepts(ll_tokenizer, tokenizer, required, [special, *body])
    assert not _accepts(ll_tokenizer, tokenizer, required, _canonical("mistral", [WEATHER, TIME]))  # text marker
    auto = MistralToolParser().grammar(TOOLS, required=False, parallel=False, special_token_ids=ids)
    assert _accepts(ll_tokenizer, tokenizer, auto, "Just text.")
    assert _accepts(ll_tokenizer, tokenizer, auto, tokenizer.encode("Ok. ", add_special_tokens=False)
                    + [special] + tokenizer.encode(_canonical("mistral", [WEATHER])[12:], add_special_tokens=False))
    assert not _accepts(ll_tokenizer, tokenizer, auto, [special, *body])  # two calls, parallel=False
    assert not _accepts(ll_tokenizer, tokenizer, auto, [special, *tokenizer.encode("oops", add_special_tokens=False)])


def test_grammar_tool_without_parameters(ll_tokenizer, tokenizer):
    tools = [{"type": "function", "function": {"name": "ping"}}]
    for name in PARSER_NAMES:
        grammar = TOOL_PARSERS[name]().grammar(tools, required=True, parallel=False, special_token_ids={})
        assert _accepts(ll_tokenizer, tokenizer, grammar, _canonical(name, [{"name": "ping", "arguments": {}}]))


# ----------------------------------------------------------------------------------------------------------------
# 5. Registry: names, "auto" by template text, templates that render tools
# ----------------------------------------------------------------------------------------------------------------

QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for tool in tools %}{{- tool | tojson }}"
    "{%- endfor %}{{- '</tools>\\nFor each function call, return a json object within <tool_call></tool_call> "
    "XML tags' }}{%- endif %}{%- for message in messages %}{{ message.content }}{%- endfor %}")
MISTRAL_TEMPLATE = ("{%- for message in messages %}{%- if message.tool_calls %}{{- '[TOOL_CALLS][' }}{%- endif %}"
                    "{%- endfor %}{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}")
LLAMA_TEMPLATE = ("{%- if tools is not none %}{%- for t in tools %}{{- t | tojson }}{%- endfor %}{%- endif %}"
                  "{%- if builtin_tools is defined %}{{- '<|python_tag|>' }}{%- endif %}"
                  "Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and "
                  "its value}.")
LLAMA_NO_TAG_TEMPLATE = ("{%- for t in tools %}{{ t | tojson }}{%- endfor %}Respond with "
                         "{\"name\": function name, \"parameters\": dictionary of argument name and its value}")
PLAIN_TEMPLATE = "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>" \
                 "{%- endfor %}"


def test_registry_names():
    assert set(TOOL_PARSERS) == {*PARSER_NAMES, "pythonic", "qwen3_coder"}  # those two: own sections below
    assert TOOL_PARSERS["hermes"] is HermesToolParser
    for name, cls in TOOL_PARSERS.items():
        assert cls.name == name and issubclass(cls, ToolParser)
    assert MistralToolParser.needs_special_tokens and Llama3JsonToolParser.needs_special_tokens
    assert not HermesToolParser.needs_special_tokens


@pytest.mark.parametrize("template,expected", [
    (QWEN_TEMPLATE, "hermes"), (MISTRAL_TEMPLATE, "mistral"), (LLAMA_TEMPLATE, "llama3_json"),
    (LLAMA_NO_TAG_TEMPLATE, "llama3_json"), (PLAIN_TEMPLATE, None), (None, None), ("", None),
    ("respond in the format [func_name1(params_name1=params_value1, params_name2=params_value2...)]", "pythonic"),
])
def test_resolve_auto_by_template(template, expected):
    parser = resolve_tool_parser("auto", template)
    assert (parser.name if parser is not None else None) == expected


def test_resolve_by_name():
    assert resolve_tool_parser(None, QWEN_TEMPLATE) is None
    for name in PARSER_NAMES:
        parser = resolve_tool_parser(name, PLAIN_TEMPLATE)  # an explicit name ignores the template
        assert isinstance(parser, TOOL_PARSERS[name])
    assert resolve_tool_parser("hermes", None) is not resolve_tool_parser("hermes", None)  # a fresh parser each
    with pytest.raises(ValueError) as err:
        resolve_tool_parser("qwen25", QWEN_TEMPLATE)
    for name in ("auto", *PARSER_NAMES, "'qwen25'"):
        assert name in str(err.value)


@pytest.mark.parametrize("template,expected", [
    (QWEN_TEMPLATE, True), (MISTRAL_TEMPLATE, True), (LLAMA_TEMPLATE, True),
    (PLAIN_TEMPLATE, False), (None, False), ("", False),
    ("{% set tools = [] %}{{ tools }}", False),  # assigned in the template, not read from the caller
    ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}{{ tools }}", True),
    ("{% if tools %}unclosed", False),  # a template jinja cannot parse renders nothing
    ("Tools: <tool_call> (in text only)", False),
])
def test_template_renders_tools(template, expected):
    assert template_renders_tools(template) is expected


def test_call_grammar_hoists_local_defs_and_refs():
    """$defs / definitions and the $refs into them (or into the schema itself: "#") keep pointing at the right
    schema once the parameters sit inside the call's JSON schema; llguidance accepts the grammar."""
    from tokenspout.sampling_params import StructuredOutputsParams
    from tokenspout.structured_output import validate
    from tokenspout.tool_parsers.grammar import call_schema

    tree = {"type": "object", "properties": {"name": {"type": "string"}, "kids": {"type": "array",
                                                                                "items": {"$ref": "#"}}}}
    nested = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}, "u": {"$ref": "#/definitions/U"}},
              "$defs": {"P": {"type": "object", "properties": {"next": {"$ref": "#/$defs/P"}}}},
              "definitions": {"U": {"enum": ["a"]}}}
    tools = [{"type": "function", "function": {"name": "tree", "parameters": tree}},
             {"type": "function", "function": {"name": "nested", "parameters": nested}},
             {"type": "function", "function": {"name": "plain", "parameters": {"type": "object"}}}]
    schema = json.loads(call_schema(tools).removeprefix("%json "))
    defs = schema["$defs"]
    assert defs["t0"]["properties"]["kids"]["items"] == {"$ref": "#/$defs/t0"}
    assert defs["t1"]["properties"] == {"p": {"$ref": "#/$defs/t1.P"}, "u": {"$ref": "#/$defs/t1.U"}}
    assert defs["t1.P"]["properties"]["next"] == {"$ref": "#/$defs/t1.P"} and defs["t1.U"] == {"enum": ["a"]}
    assert schema["anyOf"][2]["properties"]["arguments"] == {"type": "object", "additionalProperties": False}
    grammar = HermesToolParser().grammar(tools, required=True, parallel=True, special_token_ids={})
    validate(StructuredOutputsParams(grammar=grammar))


# ----------------------------------------------------------------------------------------------------------------
# pythonic (Llama 3.2 / 4): a Python list of calls with keyword arguments
# ----------------------------------------------------------------------------------------------------------------

PYTHONIC_CASES = [  # (text, content, calls)
    ("[get_weather(city='San Francisco', metric='celsius')]", "",
     [("get_weather", {"city": "San Francisco", "metric": "celsius"})]),
    ('<|python_start|>[get_weather(city="Paris"), get_time()]<|python_end|>', "",
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("[search(query=\"it's\", opts={'k': [1, 2.5, None], 'b': True}, pair=(1, 'x'),)]\n", "",
     [("search", {"query": "it's", "opts": {"k": [1, 2.5, None], "b": True}, "pair": [1, "x"]})]),
    ("The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    ("[1, 2, 3]", "[1, 2, 3]", []),
    ("[]", "[]", []),
    ("[f(x=1)]<|python_end|>\n\nAnything else?", "Anything else?", [("f", {"x": 1})]),  # text after the list
    ("<|python_start|>[f(x=1)]<|python_end|>", "", [("f", {"x": 1})]),
]
PYTHONIC_MALFORMED = ["[f(x={1, 2})]", "[f(1)]", "[f(x=1) g()]", "[f(x=)]", "[f(x=1]", "[f(x=[1, 2)]"]


@pytest.mark.parametrize("text", PYTHONIC_MALFORMED)
def test_pythonic_malformed_is_content(text):
    """A set (no JSON form), a positional argument, broken syntax: the whole reply is content at the end."""
    assert parse_final("pythonic", text) == (text, [])


@pytest.mark.parametrize("text,content,calls", PYTHONIC_CASES)
def test_pythonic_outputs_parse_and_stream(text, content, calls):
    got_content, got_calls = parse_final("pythonic", text)
    assert got_content == content
    assert [(n, json.loads(a)) for n, a in got_calls] == calls
    out = stream_chars("pythonic", text)
    assert (out.content, out.calls) == (got_content, got_calls)


def test_pythonic_generated_outputs_stream_and_parse():
    """Random argument values written as Python literals (repr) parse back to the same JSON, streamed or not."""
    rng = random.Random("tool-parsers-pythonic")
    for _ in range(40):
        calls = [(rng.choice(["get_weather", "search", "f_1"]),
                  {f"{rng.choice(['city', 'query', 'opts'])}{i}": _value(rng) for i in range(rng.randint(0, 4))})
                 for _ in range(rng.randint(1, 3))]
        sep = rng.choice([", ", ","])
        text = rng.choice(["", "<|python_start|>"]) + "[" + sep.join(
            f"{n}({sep.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls) + "]"
        got_content, got_calls = parse_final("pythonic", text)
        assert got_content == "" and [(n, json.loads(a)) for n, a in got_calls] == calls, text
        out = stream_chars("pythonic", text, check_markers=False)
        assert (out.content, out.calls) == (got_content, got_calls), text


def test_pythonic_cut_call_keeps_the_complete_arguments():
    parse = TOOL_PARSERS["pythonic"]().parse("[get_weather(city='Paris', days=", True)
    assert [(c.name, c.arguments, c.complete) for c in parse.calls] == [("get_weather", '{"city": "Paris"', False)]


def test_pythonic_grammar(ll_tokenizer, tokenizer):
    import llguidance

    parser = TOOL_PARSERS["pythonic"]()
    one, two = '[get_weather(city="Paris", days=2)]', '[get_weather(city="Paris", days=2), get_time()]'
    for required, parallel in MODES:
        grammar = parser.grammar(TOOLS, required=required, parallel=parallel, special_token_ids={})
        assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("grammar", grammar)) == ""
        assert _accepts(ll_tokenizer, tokenizer, grammar, one)
        assert _accepts(ll_tokenizer, tokenizer, grammar, '[get_weather(city="Paris")]')  # days is optional
        assert _accepts(ll_tokenizer, tokenizer, grammar, "[get_time()]")
        assert _accepts(ll_tokenizer, tokenizer, grammar, two) == parallel
        for bad in ('[get_wether(city="Paris")]', "[get_weather(city=42)]", '[get_weather(city="P", days="2")]',
                    "[get_weather(days=2)]", '[get_weather(city="P", city="Q")]'):
            assert not _accepts(ll_tokenizer, tokenizer, grammar, bad), bad
        answer = "The weather in Paris is sunny."
        assert _accepts(ll_tokenizer, tokenizer, grammar, answer) == (not required)
    calls = parser.parse(two, True).tool_calls()
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 2}),
                                                                   ("get_time", {})]


# ----------------------------------------------------------------------------------------------------------------
# qwen3_coder: XML blocks, parameter values typed by the function's schema
# ----------------------------------------------------------------------------------------------------------------

CODER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "ratio": {"type": "number"},
        "metric": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]


def _coder(*calls: tuple[str, dict[str, str]]) -> str:
    return "\n".join("<tool_call>\n<function=" + name + ">\n" + "".join(
        f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items()) + "</function>\n</tool_call>"
        for name, params in calls)


def _coder_parser():
    parser = TOOL_PARSERS["qwen3_coder"]()
    parser.bind_tools(CODER_TOOLS)
    return parser


CODER_CASES = [  # (text, content, calls)
    (_coder(("get_weather", {"city": "New York", "days": "3", "ratio": "0.5", "metric": "True",
                             "opts": '{"a": [1, null]}', "tags": "['x', 'y']"})), "",
     [("get_weather", {"city": "New York", "days": 3, "ratio": 0.5, "metric": True, "opts": {"a": [1, None]},
                       "tags": ["x", "y"]})]),
    ("Let me check.\n" + _coder(("get_weather", {"city": "42\nline two"}), ("get_time", {})) + "\nDone.",
     "Let me check.\nDone.", [("get_weather", {"city": "42\nline two"}), ("get_time", {})]),
    (_coder(("unknown_fn", {"x": "[1, 2]", "y": "plain text"})), "",
     [("unknown_fn", {"x": [1, 2], "y": "plain text"})]),  # untyped: JSON when it is JSON
    ("No tools needed: <tool> is not a marker.", "No tools needed: <tool> is not a marker.", []),
]


@pytest.mark.parametrize("text,content,calls", CODER_CASES)
def test_qwen3_coder_outputs_parse_and_stream(text, content, calls):
    parse = _coder_parser().parse(text, True)
    assert parse.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parse.tool_calls()] == calls
    stream = ToolCallStream(_coder_parser())
    out = Reassembled()
    for i in range(len(text) + 1):
        out.add(*stream.update(text[:i], final=False))
        assert "<tool_c" not in out.content
    out.add(*stream.update(text, final=True))
    assert (out.content, out.calls) == (parse.content, [(c.name, c.arguments) for c in parse.tool_calls()])


@pytest.mark.parametrize("text", [
    _coder(("get_weather", {"city": "Paris", "days": "many"})),  # not an integer
    "<tool_call>\n<junk>\n</tool_call>",
    "<tool_call>\n<function=f>\nstray text\n</function>\n</tool_call>",
])
def test_qwen3_coder_malformed_block_is_content(text):
    parse = _coder_parser().parse(text, True)
    assert (parse.content, parse.calls) == (text, [])


def test_qwen3_coder_cut_call_keeps_complete_parameters():
    text = _coder(("get_weather", {"city": "Paris", "days": "3"}))
    cut = text[:text.index("3\n</parameter>")]
    (call,) = _coder_parser().parse(cut, True).calls
    assert (call.name, call.arguments, call.complete) == ("get_weather", '{"city": "Paris"', False)


def test_qwen3_coder_grammar(ll_tokenizer, tokenizer):
    import llguidance

    parser = _coder_parser()
    one = _coder(("get_weather", {"city": "Paris", "days": "2"}))
    two = one + "\n" + _coder(("get_time", {}))
    for required, parallel in MODES:
        grammar = parser.grammar(CODER_TOOLS, required=required, parallel=parallel, special_token_ids={})
        assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("grammar", grammar)) == ""
        assert _accepts(ll_tokenizer, tokenizer, grammar, one)
        assert _accepts(ll_tokenizer, tokenizer, grammar, _coder(("get_weather", {"city": "a </para b"})))
        assert _accepts(ll_tokenizer, tokenizer, grammar, _coder(("get_weather", {"city": "P", "opts": '{"k":1}'})))
        assert _accepts(ll_tokenizer, tokenizer, grammar, two) == parallel
        for bad in (one.replace("get_weather", "get_wether"), one.replace("\n2\n", "\ntwo\n"),
                    _coder(("get_weather", {"days": "2"})), _coder(("get_weather", {"city": "P", "opts": "[1]"}))):
            assert not _accepts(ll_tokenizer, tokenizer, grammar, bad), bad
        assert _accepts(ll_tokenizer, tokenizer, grammar, "The weather is fine.") == (not required)
        if not required:
            assert _accepts(ll_tokenizer, tokenizer, grammar, "Let me check.\n" + one)
