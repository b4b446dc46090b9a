"""Reasoning parsers (deepseek_r1, qwen3): the split of a reply into reasoning and answer for each way a prompt
can open or close the reasoning, a reply streamed one character at a time through ChatOutputParser.delta
reassembling to ChatOutputParser.final (with and without a tool parser), and grammars applied only after the
reasoning (StructuredOutputsParams.reasoning_end)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokenspout.engine.chat_output import ChatOutputParser, DeltaParts
from tokenspout.outputs import MessageParts
from tokenspout.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningSplit,
    reasoning_parser_class,
)
from tokenspout.sampling_params import StructuredOutputsParams
from tokenspout.structured_output.llguidance_backend import after_reasoning, grammar_spec
from tokenspout.tool_parsers import TOOL_PARSERS

# Rendered prompts, as the chat templates end them.
OPEN_PROMPT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
THINK_PROMPT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n"  # R1 templates
NO_THINK_PROMPT = OPEN_PROMPT + "<think>\n\n</think>\n\n"  # Qwen3 with enable_thinking: false

QWEN3_REPLY = "<think>\nThe user asks 2+2. That is 4.\n</think>\n\n2 + 2 = **4**."
R1_REPLY = "Okay, so the user wants 2+2. Simple: 4.\n</think>\n\nThe answer is 4."  # <think> was in the prompt
TOOL_REPLY = ("<think>\nThe user wants the weather in Zürich; I should call get_weather with city \"Zürich\".\n"
              "</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\", "
              "\"unit\": \"celsius\"}}\n</tool_call>")


def split(parser: str, prompt: str, text: str, final: bool) -> tuple[str, str, bool]:
    s = REASONING_PARSERS[parser](prompt).split(text, final)
    return s.reasoning, s.answer, s.ended


# ----------------------------------------------------------------------------------------------------------------
# split
# ----------------------------------------------------------------------------------------------------------------

SPLITS = [
    # parser, prompt, text, final -> reasoning, answer, ended
    # the model writes <think> itself
    ("qwen3", OPEN_PROMPT, QWEN3_REPLY, True,
     ("\nThe user asks 2+2. That is 4.\n", "\n\n2 + 2 = **4**.", True)),
    ("deepseek_r1", OPEN_PROMPT, QWEN3_REPLY, True,
     ("\nThe user asks 2+2. That is 4.\n", "\n\n2 + 2 = **4**.", True)),
    ("qwen3", OPEN_PROMPT, "\n<think>x</think>y", True, ("x", "y", True)),  # whitespace before <think>
    # no <think> in the reply
    ("deepseek_r1", OPEN_PROMPT, R1_REPLY, True,  # R1: the reply starts inside the reasoning
     ("Okay, so the user wants 2+2. Simple: 4.\n", "\n\nThe answer is 4.", True)),
    ("qwen3", OPEN_PROMPT, R1_REPLY, True, ("", R1_REPLY, True)),  # qwen3: no <think>, all answer
    ("qwen3", OPEN_PROMPT, "2 + 2 = 4.", True, ("", "2 + 2 = 4.", True)),
    ("deepseek_r1", OPEN_PROMPT, "2 + 2 = 4.", True, ("2 + 2 = 4.", "", False)),  # never closed: all reasoning
    # the prompt ends with <think>: the reply starts inside the reasoning, for either parser
    ("qwen3", THINK_PROMPT, R1_REPLY, True,
     ("Okay, so the user wants 2+2. Simple: 4.\n", "\n\nThe answer is 4.", True)),
    ("deepseek_r1", THINK_PROMPT, R1_REPLY, True,
     ("Okay, so the user wants 2+2. Simple: 4.\n", "\n\nThe answer is 4.", True)),
    ("qwen3", THINK_PROMPT, "still thinking", False, ("still thinking", "", False)),
    # the prompt closed the reasoning (thinking disabled): all answer, even text that looks like reasoning
    ("qwen3", NO_THINK_PROMPT, "2 + 2 = 4.", True, ("", "2 + 2 = 4.", True)),
    ("deepseek_r1", NO_THINK_PROMPT, "2 + 2 = 4.", False, ("", "2 + 2 = 4.", True)),
    ("deepseek_r1", NO_THINK_PROMPT, QWEN3_REPLY, True, ("", QWEN3_REPLY, True)),
    # no end marker: cut off (final) vs still growing (not final, a partial end marker held back)
    ("qwen3", OPEN_PROMPT, "<think>\nHmm, let me see", True, ("\nHmm, let me see", "", False)),
    ("qwen3", OPEN_PROMPT, "<think>\nHmm, let me see", False, ("\nHmm, let me see", "", False)),
    ("qwen3", OPEN_PROMPT, "<think>\nHmm</thi", False, ("\nHmm", "", False)),
    ("qwen3", OPEN_PROMPT, "<think>\nHmm</thi", True, ("\nHmm</thi", "", False)),
    ("deepseek_r1", OPEN_PROMPT, "Hmm <", False, ("Hmm ", "", False)),
    ("deepseek_r1", OPEN_PROMPT, "Hmm <", True, ("Hmm <", "", False)),
    ("deepseek_r1", OPEN_PROMPT, "Hmm</think>", False, ("Hmm", "", True)),
    # what may still become <think> is undecided while the text grows
    ("qwen3", OPEN_PROMPT, "<thi", False, ("", "", False)),
    ("qwen3", OPEN_PROMPT, "<thi", True, ("", "<thi", True)),
    ("qwen3", OPEN_PROMPT, "\n\n", False, ("", "", False)),
    ("qwen3", OPEN_PROMPT, "<think>", False, ("", "", False)),
    ("deepseek_r1", OPEN_PROMPT, "<thi", False, ("", "", False)),
    ("deepseek_r1", OPEN_PROMPT, "<thi", True, ("<thi", "", False)),
    ("deepseek_r1", OPEN_PROMPT, " \n", False, ("", "", False)),
    ("qwen3", OPEN_PROMPT, "<b>bold</b>", False, ("", "<b>bold</b>", True)),  # not <think>: an answer
    ("qwen3", OPEN_PROMPT, "", True, ("", "", True)),
    # only the first end marker ends the reasoning
    ("qwen3", OPEN_PROMPT, "<think>a</think>b</think>c", True, ("a", "b</think>c", True)),
]


@pytest.mark.parametrize("parser,prompt,text,final,expected", SPLITS)
def test_split(parser, prompt, text, final, expected):
    assert split(parser, prompt, text, final) == expected


def test_prompt_flags():
    for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser):
        assert cls(NO_THINK_PROMPT).starts_in_answer()
        assert cls(NO_THINK_PROMPT + "  \n").prompt_closed  # trailing whitespace does not hide it
        assert not cls(THINK_PROMPT).starts_in_answer() and cls(THINK_PROMPT).prompt_opened
        assert not cls(OPEN_PROMPT).starts_in_answer() and not cls(OPEN_PROMPT).prompt_opened
        assert not cls().starts_in_answer()
        assert cls().end_marker == "</think>"
    assert DeepSeekR1ReasoningParser.opens_in_reasoning and not Qwen3ReasoningParser.opens_in_reasoning


def test_registry():
    assert REASONING_PARSERS == {"deepseek_r1": DeepSeekR1ReasoningParser, "qwen3": Qwen3ReasoningParser}
    assert reasoning_parser_class(None) is None
    assert reasoning_parser_class("qwen3") is Qwen3ReasoningParser
    with pytest.raises(ValueError) as err:
        reasoning_parser_class("granite")
    assert "deepseek_r1" in str(err.value) and "qwen3" in str(err.value) and "'granite'" in str(err.value)


@pytest.mark.parametrize("parser", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("prompt", [OPEN_PROMPT, THINK_PROMPT, NO_THINK_PROMPT], ids=["open", "think", "no-think"])
@pytest.mark.parametrize("text", [QWEN3_REPLY, R1_REPLY, "\n<think>x</think>y", "plain answer", "<think>cut </thi"])
def test_split_grows_by_appending(parser, prompt, text):
    """Every prefix's split extends the previous one, and ends at the final split."""
    p = REASONING_PARSERS[parser](prompt)
    previous = ReasoningSplit("", "", False)
    for i in range(len(text) + 1):
        s = p.split(text[:i], False)
        assert s.reasoning.startswith(previous.reasoning), (text[:i], previous, s)
        assert s.answer.startswith(previous.answer), (text[:i], previous, s)
        assert not (previous.ended and not s.ended and previous.answer)
        assert "</think>" not in s.reasoning and not s.reasoning.endswith(("<", "</", "</th"))
        previous = s
    final = p.split(text, True)
    assert final.reasoning.startswith(previous.reasoning) and final.answer.startswith(previous.answer)


# ----------------------------------------------------------------------------------------------------------------
# ChatOutputParser: delta (streamed char by char) reassembles to final
# ----------------------------------------------------------------------------------------------------------------


def _parser(tool: str | None, reasoning: str | None, prompt: str) -> ChatOutputParser:
    return ChatOutputParser(TOOL_PARSERS[tool]() if tool else None,
                            REASONING_PARSERS[reasoning](prompt) if reasoning else None)


def _stream(tool: str | None, reasoning: str | None, prompt: str, text: str) -> dict[str, Any]:
    """The reply fed one character at a time, then an empty final delta; reassembled as a client does."""
    parser = _parser(tool, reasoning, prompt)
    whole = _parser(tool, reasoning, prompt).final(text)
    content = reasoning_text = ""
    calls: list[dict[str, str]] = []
    ids: list[str] = []
    for i, piece in enumerate([*text, ""]):
        d = parser.delta(piece, final=i == len(text))
        assert isinstance(d, DeltaParts)
        assert bool(d) == bool(d.content or d.reasoning or d.tool_calls)
        content += d.content
        reasoning_text += d.reasoning
        for tc in d.tool_calls:
            if "id" in tc:
                assert tc["index"] == len(calls) and tc["type"] == "function"
                ids.append(tc["id"])
                calls.append({"name": tc["function"]["name"], "arguments": tc["function"]["arguments"]})
            else:
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
        # a marker in the making is never shown: what is shown so far is the start of the final message's parts
        assert (whole.reasoning or "").startswith(reasoning_text), (text[:i], reasoning_text)
        assert (whole.content or "").startswith(content), (text[:i], content)
    return {"content": content, "reasoning": reasoning_text, "calls": calls, "called": parser.called_tools}


def _final(tool: str | None, reasoning: str | None, prompt: str, text: str) -> dict[str, Any]:
    m = _parser(tool, reasoning, prompt).final(text)
    assert isinstance(m, MessageParts)
    for tc in m.tool_calls:
        assert tc["type"] == "function" and tc["id"]
    return {"content": m.content or "", "reasoning": m.reasoning or "",
            "calls": [dict(tc["function"]) for tc in m.tool_calls], "called": bool(m.tool_calls)}


STREAM_TEXTS = [QWEN3_REPLY, R1_REPLY, TOOL_REPLY, "\n<think>abc</think>X", "  <think>\nhm</think>\n\nok",
                "Just an answer, no reasoning.", "<think>\ncut off mid-thought </thi", "", "\n\n",
                "<think></think>", "<b>html</b> answer"]


@pytest.mark.parametrize("tool", [None, "hermes"])
@pytest.mark.parametrize("reasoning", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("prompt", [OPEN_PROMPT, THINK_PROMPT, NO_THINK_PROMPT], ids=["open", "think", "no-think"])
def test_streamed_equals_final(tool, reasoning, prompt):
    for text in STREAM_TEXTS:
        assert _stream(tool, reasoning, prompt, text) == _final(tool, reasoning, prompt, text), text


def test_reasoning_then_tool_call():
    final = _parser("hermes", "qwen3", OPEN_PROMPT).final(TOOL_REPLY)
    assert final.reasoning == ("\nThe user wants the weather in Zürich; I should call get_weather with city "
                               "\"Zürich\".\n")
    assert final.content is None  # only calls, after the reasoning
    assert len(final.tool_calls) == 1
    fn = final.tool_calls[0]["function"]
    assert fn["name"] == "get_weather" and json.loads(fn["arguments"]) == {"city": "Zürich", "unit": "celsius"}
    streamed = _stream("hermes", "qwen3", OPEN_PROMPT, TOOL_REPLY)
    assert streamed["called"] and streamed["calls"] == [fn]
    assert streamed["reasoning"] == final.reasoning and streamed["content"] == ""


def test_tool_call_markers_in_the_reasoning_are_not_calls():
    """A model thinking about the call format writes <tool_call> in its reasoning: only the answer is parsed."""
    text = ("<think>I will write <tool_call>\n{\"name\": \"x\", \"arguments\": {}}\n</tool_call> next.</think>\n"
            "No call needed: it is 4.")
    final = _parser("hermes", "deepseek_r1", OPEN_PROMPT).final(text)
    assert final.tool_calls == [] and final.content == "\nNo call needed: it is 4."
    assert "<tool_call>" in final.reasoning
    assert _stream("hermes", "deepseek_r1", OPEN_PROMPT, text) == _final("hermes", "deepseek_r1", OPEN_PROMPT, text)


def test_reasoning_and_tool_call_with_text_between():
    text = ("<think>Need two cities.</think>\n\nChecking both.\n<tool_call>\n{\"name\": \"w\", \"arguments\": "
            "{\"c\": \"Oslo\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"w\", \"arguments\": {\"c\": \"Köln\"}}\n"
            "</tool_call>")
    final = _parser("hermes", "qwen3", OPEN_PROMPT).final(text)
    assert final.reasoning == "Need two cities." and final.content == "\n\nChecking both."
    assert [json.loads(tc["function"]["arguments"]) for tc in final.tool_calls] == [{"c": "Oslo"}, {"c": "Köln"}]
    assert len({tc["id"] for tc in final.tool_calls}) == 2
    assert _stream("hermes", "qwen3", OPEN_PROMPT, text) == _final("hermes", "qwen3", OPEN_PROMPT, text)


def test_message_parts_shapes():
    # neither parser: the text is content, untouched
    plain = ChatOutputParser(None, None)
    assert not plain.active
    assert plain.final("  hi <think>  ") == MessageParts("  hi <think>  ", None, [])
    assert plain.delta("a", False) == DeltaParts("a") and plain.delta("b", True) == DeltaParts("b")
    assert not plain.called_tools
    # reasoning only, no answer: content None; an empty reply with no reasoning: content ""
    r1 = _parser(None, "deepseek_r1", OPEN_PROMPT)
    assert r1.active
    assert r1.final("thinking, cut off") == MessageParts(None, "thinking, cut off", [])
    assert _parser(None, "qwen3", OPEN_PROMPT).final("") == MessageParts("", None, [])
    assert _parser(None, "qwen3", OPEN_PROMPT).final("<think></think>") == MessageParts("", None, [])
    # tools but no call: content, and "" rather than None when there is nothing at all
    assert _parser("hermes", None, "").final("Hi.") == MessageParts("Hi.", None, [])
    assert _parser("hermes", None, "").final("") == MessageParts("", None, [])
    assert _parser("hermes", "qwen3", OPEN_PROMPT).final("<think>x</think>") == MessageParts(None, "x", [])


def test_delta_is_falsy_while_a_marker_is_held_back():
    p = _parser("hermes", "qwen3", OPEN_PROMPT)
    assert not p.delta("<th", False)  # may become <think>
    assert p.delta("ink>ab", False) == DeltaParts(reasoning="ab")
    assert not p.delta("</thi", False)  # may end the reasoning
    assert p.delta("nk>\n\nOk <tool_", False) == DeltaParts(content="\n\nOk")
    assert p.delta("", True) == DeltaParts(content=" <tool_")


# ----------------------------------------------------------------------------------------------------------------
# Grammars after the reasoning
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer):
    """llguidance's view of the default model's tokenizer (SmolLM2, from conftest's session `tokenizer`)."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer)


def _accepts(ll_tokenizer, tokenizer, spec: str, text: str) -> bool:
    import llguidance

    matcher = llguidance.LLMatcher(ll_tokenizer, spec, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                     "additionalProperties": False})


def test_json_after_reasoning(ll_tokenizer, tokenizer):
    spec = grammar_spec(StructuredOutputsParams(json=SCHEMA, reasoning_end="</think>"))
    assert _accepts(ll_tokenizer, tokenizer, spec, 'thinking...</think>\n{"a":1}')
    assert not _accepts(ll_tokenizer, tokenizer, spec, "x</think>oops")
    assert _accepts(ll_tokenizer, tokenizer, spec, '<think>\nA {"b": [ } mess, "</thin k>"?\n</think>\n\n{"a":42}')
    assert not _accepts(ll_tokenizer, tokenizer, spec, 'x</think>{"a":"1"}')  # the schema holds after it
    assert not _accepts(ll_tokenizer, tokenizer, spec, '{"a":1}')  # the reasoning's end comes first
    assert not _accepts(ll_tokenizer, tokenizer, spec, 'x</think>{"a":1} and more')
    # without reasoning_end the same schema applies from the first token
    plain = grammar_spec(StructuredOutputsParams(json=SCHEMA))
    assert _accepts(ll_tokenizer, tokenizer, plain, '{"a":1}')
    assert not _accepts(ll_tokenizer, tokenizer, plain, 'thinking...</think>\n{"a":1}')


def test_regex_and_choice_after_reasoning(ll_tokenizer, tokenizer):
    regex = grammar_spec(StructuredOutputsParams(regex=r"[0-9]+", reasoning_end="</think>"))
    assert _accepts(ll_tokenizer, tokenizer, regex, "2+2 is four</think> 4")
    assert not _accepts(ll_tokenizer, tokenizer, regex, "2+2 is four</think> four")
    choice = grammar_spec(StructuredOutputsParams(choice=["yes", "no"], reasoning_end="</think>"))
    assert _accepts(ll_tokenizer, tokenizer, choice, "hmm</think>\n\nyes")
    assert not _accepts(ll_tokenizer, tokenizer, choice, "hmm</think>\n\nmaybe")


def test_tool_grammar_after_reasoning(ll_tokenizer, tokenizer):
    """A reasoning model's tool grammar: free reasoning, then the constrained call (as chat_tools.constrain
    builds it)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    grammar = TOOL_PARSERS["hermes"]().grammar(tools, required=True, parallel=False, special_token_ids={})
    spec = grammar_spec(StructuredOutputsParams(grammar=grammar, reasoning_end="</think>"))
    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Zürich"}}\n</tool_call>'
    assert _accepts(ll_tokenizer, tokenizer, spec, "<think>\nNeed the weather.\n</think>\n\n" + call)
    assert not _accepts(ll_tokenizer, tokenizer, spec, "<think>\nNeed the weather.\n</think>\n\nIt is sunny.")
    assert not _accepts(ll_tokenizer, tokenizer, spec, call)  # no reasoning end yet: the call is still reasoning


def test_after_reasoning_wraps_any_spec():
    lark = json.loads(after_reasoning("start: /[a-z]+/", "</think>"))
    assert lark["grammars"][1] == {"lark_grammar": "start: /[a-z]+/", "name": "answer"}
    assert "@answer" in lark["grammars"][0]["lark_grammar"]
    assert "<\\/think>" in lark["grammars"][0]["lark_grammar"]  # the marker is escaped for the regex


def test_optional_reasoning_grammar(ll_tokenizer, tokenizer):
    """qwen3 (the reply is reasoning only when it opens with <think>): the answer's grammar holds from the first
    token of a reply without <think>, and after </think> in one with it (vLLM-test finding: it held only after a
    </think> that a reply without reasoning never writes)."""
    spec = grammar_spec(StructuredOutputsParams(json=SCHEMA, reasoning_end="</think>", reasoning_start="<think>"))
    assert _accepts(ll_tokenizer, tokenizer, spec, '{"a":1}')
    assert _accepts(ll_tokenizer, tokenizer, spec, '<think>\nhmm {not json}\n</think>\n\n{"a":1}')
    assert not _accepts(ll_tokenizer, tokenizer, spec, "Sure, here it is.")
    assert not _accepts(ll_tokenizer, tokenizer, spec, 'thinking</think>{"a":1}')  # reasoning must open with it
    assert not _accepts(ll_tokenizer, tokenizer, spec, "<think>x</think>\nfree text")
    assert Qwen3ReasoningParser("").optional_start == "<think>"
    assert DeepSeekR1ReasoningParser("").optional_start is None
    assert Qwen3ReasoningParser("<|im_start|>assistant\n<think>\n").optional_start is None  # opened by the prompt
