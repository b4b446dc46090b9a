"""Reasoning and tool-call parsing over HTTP with the openai client, on recorded model outputs: a scripted engine
(the fake engine's contract, replying with a fixed text one character per token) behind the real server, so the
whole path (parsers, SSE deltas, the client's own models) runs on exactly the text a reasoning model writes.
The oracle of each stream is the non-streamed response to the same request, and the recorded text's known split."""

from __future__ import annotations

import openai
import pytest

from tests.unit.fake_engine import _CHAR_BASE, FakeEngine, _Plan
from tokenspout.entrypoints.openai.api_server import BackgroundServer, build_app

THINK = "<think>\nThe user greets me. I should answer briefly.\n</think>\n\n"
ANSWER = "Hello! How can I help you today?"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools }} <tool_call>"


class ScriptedEngine(FakeEngine):
    """Replies with `script` (one character per token), whatever the prompt; the chat template (read for tool
    support) is TOOL_TEMPLATE."""

    chat_template = TOOL_TEMPLATE

    def __init__(self) -> None:
        super().__init__(model_name="scripted")
        self.script = ""

    def _plan(self, prompt_ids, sp, choice) -> _Plan:
        text = self.script[: sp.max_tokens] if sp.max_tokens is not None else self.script
        finish = "length" if len(text) < len(self.script) else "stop"
        return _Plan([_CHAR_BASE + ord(c) for c in text], list(text), text, finish, None)


@pytest.fixture(scope="module", params=["deepseek_r1", "qwen3"])
def served(request):
    engine = ScriptedEngine()
    srv = BackgroundServer(build_app(engine, reasoning_parser=request.param, tool_call_parser="hermes")).start()
    yield engine, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0), request.param
    srv.stop()


def stream_parts(client, **kw):
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(model="scripted", stream=True, **kw):
        for c in chunk.choices:
            d = c.delta
            reasoning += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
            for tc in d.tool_calls or []:
                e = calls.setdefault(tc.index, ["", ""])
                e[0] += tc.function.name or ""
                e[1] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return reasoning, content, [tuple(v) for _, v in sorted(calls.items())], finish


MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("script, reasoning, content", [
    (THINK + ANSWER, THINK[len("<think>"):THINK.index("</think>")], "\n\n" + ANSWER),
    (ANSWER, None, ANSWER),
])
def test_reasoning_is_split_streamed_and_not(served, script, reasoning, content):
    engine, client, parser = served
    engine.script = script
    if parser == "deepseek_r1" and "<think>" not in script:
        reasoning, content = script, None  # R1's rule: no end marker, all reasoning
    whole = client.chat.completions.create(model="scripted", messages=MSGS, max_tokens=200).choices[0]
    msg = whole.message.model_dump()
    assert msg.get("reasoning_content") == reasoning and msg.get("reasoning") == reasoning
    assert whole.message.content == content
    s_reasoning, s_content, calls, finish = stream_parts(client, messages=MSGS, max_tokens=200)
    assert (s_reasoning or None, s_content or None) == (reasoning, content)
    assert "<think" not in s_content and "</think" not in s_reasoning and not calls
    assert finish == whole.finish_reason == "stop"


def test_reasoning_cut_by_max_tokens_stays_reasoning(served):
    engine, client, _ = served
    engine.script = THINK + ANSWER
    whole = client.chat.completions.create(model="scripted", messages=MSGS, max_tokens=20).choices[0]
    assert whole.finish_reason == "length"
    assert whole.message.model_dump()["reasoning_content"] == THINK[len("<think>"):20]
    assert whole.message.content is None
    assert stream_parts(client, messages=MSGS, max_tokens=20)[:2] == (THINK[len("<think>"):20], "")


def test_a_tool_call_after_reasoning_is_parsed_from_the_answer_only(served):
    engine, client, _ = served
    engine.script = THINK + CALL
    kw = {"messages": MSGS, "tools": TOOLS, "max_tokens": 300}
    whole = client.chat.completions.create(model="scripted", **kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == \
        [("get_weather", '{"city": "Paris"}')]
    assert whole.message.model_dump()["reasoning_content"].startswith("\nThe user greets me.")
    reasoning, content, calls, finish = stream_parts(client, **kw)
    assert calls == [("get_weather", '{"city": "Paris"}')] and content == "" and finish == "tool_calls"
    assert reasoning == whole.message.model_dump()["reasoning_content"]


def test_a_call_inside_the_reasoning_is_not_a_call(served):
    engine, client, _ = served
    engine.script = "<think>\nmaybe " + CALL + "\n</think>\n\nNo tool needed."
    whole = client.chat.completions.create(model="scripted", messages=MSGS, tools=TOOLS, max_tokens=300).choices[0]
    assert whole.message.tool_calls == [] and whole.finish_reason == "stop"
    assert whole.message.content == "\n\nNo tool needed."  # the answer as written (as vLLM)
    assert CALL in whole.message.model_dump()["reasoning_content"]
