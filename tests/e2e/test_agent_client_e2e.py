"""An agent framework's client against the real server: LangChain's ChatOpenAI (langchain-openai) runs one
tool-using loop end to end.

Turn 1 forces a call (tool_choice "required": grammar-constrained, so it is a valid call whatever the tiny model
would say), LangChain parses it into `AIMessage.tool_calls`, the `@tool` runs with the model's arguments, its
ToolMessage goes back in turn 2 (tool_choice "none") and the model answers in text.  Every request body LangChain
sent is recorded (an httpx event hook on the SDK's client), and the server's POST /tokenize shows that turn 2's
prompt held the call and its result, token for token.
"""

from __future__ import annotations

import json
import os

import httpx
import jsonschema
import langchain_openai
import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool

WEATHER = "Sunny, 21 degrees Celsius, light wind from the west."
CALLS: list[str] = []  # what get_weather was called with


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    CALLS.append(city)
    return WEATHER


@pytest.fixture(scope="module", autouse=True)
def no_tracing():
    """No LangSmith: nothing may try to reach the network (there is none here)."""
    with pytest.MonkeyPatch.context() as mp:
        for name in list(os.environ):
            if name.startswith(("LANGSMITH_", "LANGCHAIN_")):
                mp.delenv(name)
        mp.setenv("LANGSMITH_TRACING", "false")
        mp.setenv("LANGCHAIN_TRACING_V2", "false")
        yield


@pytest.fixture(scope="module")
def server(tools_server):
    return tools_server[1]


@pytest.fixture(scope="module")
def model(server) -> str:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    return client.models.list().data[0].id


def _tokenize(server, messages: list[dict]) -> int:
    r = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def _as_template_reads(messages: list[dict]) -> list[dict]:
    """The chat route hands a call's JSON-string `arguments` to the template as an object (as vLLM does);
    /tokenize passes messages as they are, so do the same here to render what the chat route rendered."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "function": {**c["function"],
                                                        "arguments": json.loads(c["function"]["arguments"])}}
                                     for c in m["tool_calls"]]}
        out.append(m)
    return out


def test_langchain_tool_loop(server, model):
    sent: list[dict] = []

    def record(request) -> None:
        if request.url.path.endswith("/chat/completions"):
            sent.append(json.loads(request.read()))

    http_client = openai.DefaultHttpxClient(event_hooks={"request": [record]}, timeout=60)
    llm = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="x", model=model, temperature=0,
                                      seed=0, max_tokens=48, max_retries=0, timeout=60, http_client=http_client,
                                      use_responses_api=False)
    CALLS.clear()
    history = [HumanMessage("What is the weather in Paris right now?")]

    # Turn 1: one call is forced (without parallel_tool_calls=False this model repeats the call until
    # max_tokens); LangChain parses the server's tool_calls into dict args.
    ai = llm.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False).invoke(history)
    assert isinstance(ai, AIMessage)
    assert not ai.invalid_tool_calls, ai.invalid_tool_calls
    assert len(ai.tool_calls) == 1, ai
    assert not ai.content, ai  # the call's markup is not left in the text
    call = ai.tool_calls[0]
    assert call["name"] == "get_weather"
    assert call["id"]
    assert isinstance(call["args"], dict)
    schema = convert_to_openai_tool(get_weather)["function"]["parameters"]
    jsonschema.validate(call["args"], schema)
    assert ai.response_metadata.get("finish_reason") == "tool_calls"
    assert sent[0]["tool_choice"] == "required" and sent[0]["parallel_tool_calls"] is False
    assert sent[0]["tools"][0]["function"]["name"] == "get_weather"
    prompt1 = ai.usage_metadata["input_tokens"]

    # The tool runs with the model's arguments; invoked with the ToolCall, it answers with a ToolMessage.
    result = get_weather.invoke(call)
    assert isinstance(result, ToolMessage)
    assert CALLS == [call["args"]["city"]]
    assert result.tool_call_id == call["id"] and result.content == WEATHER
    history += [ai, result]

    # Turn 2: no call allowed; the model answers in text.
    final = llm.bind_tools([get_weather], tool_choice="none").invoke(history)
    assert isinstance(final, AIMessage)
    assert final.tool_calls == [] and final.invalid_tool_calls == []
    assert isinstance(final.content, str) and final.content.strip(), final
    assert final.response_metadata.get("finish_reason") in ("stop", "length")
    assert len(CALLS) == 1  # the tool ran once, in turn 1 only

    # LangChain sent the call back under the id the server gave it, and the tool's result under that id.
    assert len(sent) == 2
    body = sent[1]
    assert body["tool_choice"] == "none"
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["user", "assistant", "tool"], roles
    echoed = body["messages"][1]["tool_calls"][0]
    assert echoed["id"] == call["id"] and echoed["function"]["name"] == "get_weather"
    assert json.loads(echoed["function"]["arguments"]) == call["args"]
    assert body["messages"][2]["tool_call_id"] == call["id"] and body["messages"][2]["content"] == WEATHER

    # Turn 2's prompt is turn 1's plus the rendered call and <tool_response> turn, token for token: the server
    # fed the model what LangChain sent.  (Both prompts share the tools' system block, which /tokenize leaves
    # out; it cancels in the difference.)
    prompt2 = final.usage_metadata["input_tokens"]
    grown = _tokenize(server, _as_template_reads(body["messages"])) - _tokenize(server, sent[0]["messages"])
    result_tokens = _tokenize(server, [{"role": "tool", "tool_call_id": call["id"], "content": WEATHER}])
    assert grown > result_tokens > 0
    assert prompt2 - prompt1 == grown, (prompt1, prompt2, grown)
