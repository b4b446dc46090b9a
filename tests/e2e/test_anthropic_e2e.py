"""POST /v1/messages and /v1/messages/count_tokens through the official `anthropic` client against the real server
(the default model with the tool-capable ChatML template, shared with the tool-calling tests): plain and streamed
replies, a tool_use / tool_result round trip, stop_sequences, count_tokens, the error shape and x-api-key."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.helpers import background_server

# This client release no longer takes temperature / top_p / top_k as arguments; the API still does (vLLM's too).
GREEDY = {"temperature": 0}
WEATHER_TOOL = {"name": "get_weather", "description": "Get the current weather in a city.",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                 "required": ["city"]}}


@pytest.fixture(scope="module")
def server(tools_server):
    return tools_server[1]


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]


def test_plain_and_streamed_messages_agree(client, model):
    kw = dict(model=model, max_tokens=12, extra_body=GREEDY, system="Answer in one word.",
              messages=[{"role": "user", "content": "Name a colour."}])
    m = client.messages.create(**kw)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert 0 < m.usage.output_tokens <= 12
    assert m.usage.input_tokens == client.messages.count_tokens(
        model=model, system=kw["system"], messages=kw["messages"]).input_tokens

    with client.messages.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert final.content[0].text == m.content[0].text  # greedy: the stream reassembles to the plain reply
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens
    assert final.usage.input_tokens == m.usage.input_tokens


def test_stop_sequences(client, model):
    plain = client.messages.create(model=model, max_tokens=16, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": "Count: one, two, three"}])
    words = plain.content[0].text.split()
    assert len(words) >= 2
    stop = words[1]
    m = client.messages.create(model=model, max_tokens=16, extra_body=GREEDY, stop_sequences=[stop],
                               messages=[{"role": "user", "content": "Count: one, two, three"}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert stop not in m.content[0].text


def test_tool_use_then_tool_result(client, model):
    question = {"role": "user", "content": "What is the weather in Paris?"}
    m = client.messages.create(model=model, max_tokens=48, extra_body=GREEDY, tools=[WEATHER_TOOL],
                               tool_choice={"type": "any", "disable_parallel_tool_use": True}, messages=[question])
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id
    jsonschema.validate(uses[0].input, WEATHER_TOOL["input_schema"])

    # the same call streamed: the tool_use block's input arrives as input_json_delta fragments
    with client.messages.stream(model=model, max_tokens=48, extra_body=GREEDY, tools=[WEATHER_TOOL],
                                tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                                messages=[question]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial: dict[int, str] = {}  # the input_json_delta fragments by block
    for e in events:
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta":
            partial[e.index] = partial.get(e.index, "") + e.delta.partial_json
    assert partial and all(final.content[i].type == "tool_use" and json.loads(text) == final.content[i].input
                           for i, text in partial.items())
    assert final.stop_reason == "tool_use"

    # the round trip: tool_use back in the assistant turn, tool_result in the user's; no call allowed now
    history = [question, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                             "content": "Sunny, 21 C."}]}]
    m2 = client.messages.create(model=model, max_tokens=16, extra_body=GREEDY, tools=[WEATHER_TOOL],
                                tool_choice={"type": "none"}, messages=history)
    assert [b.type for b in m2.content] == ["text"] and m2.stop_reason in ("end_turn", "max_tokens")
    count = client.messages.count_tokens(model=model, tools=[WEATHER_TOOL], messages=history).input_tokens
    assert m2.usage.input_tokens == count
    assert count > client.messages.count_tokens(model=model, tools=[WEATHER_TOOL],
                                                messages=[question]).input_tokens + 10


def test_errors_are_in_anthropics_shape(client, server, model):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=model, max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nonexistent", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    r = httpx.post(server.url + "/v1/messages", timeout=30, json={
        "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]})
    assert r.status_code == 400 and r.json()["type"] == "error" and "messages" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/messages", json={"model": model, "max_tokens": 4, "messages": [], "top_a": 1},
                   timeout=30)
    assert r.status_code == 400 and "top_a" in r.json()["error"]["message"]


def test_x_api_key_is_accepted(tools_server, model):
    engine = tools_server[0]
    with background_server(engine, api_key="sekret") as srv:
        ok = anthropic.Anthropic(base_url=srv.url, api_key="sekret", max_retries=0, timeout=60)
        assert ok.messages.count_tokens(model=model, messages=[{"role": "user", "content": "hi"}]).input_tokens > 0
        bad = anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0, timeout=60)
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.count_tokens(model=model, messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["error"]["type"] == "authentication_error"
