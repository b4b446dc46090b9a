"""POST /v1/responses through the official `openai` client against the real server (the default model with the
tool-capable ChatML template, shared with the tool-calling tests): plain and streamed replies, the event sequence,
a function_call / function_call_output round trip, text.format json_schema, previous_response_id, the store's
GET / DELETE, and the 400s."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

WEATHER_TOOL = {
    "type": "function", "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def server(tools_server):
    return tools_server[1]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _count(server, messages: list[dict]) -> int:
    r = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_plain_and_streamed_replies_agree(client, model, server):
    kw = dict(model=model, input="Name a colour.", instructions="Answer in one word.", max_output_tokens=12,
              temperature=0)
    r = client.responses.create(**kw)
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.status in ("completed", "incomplete")
    assert [item.type for item in r.output] == ["message"]
    assert r.output_text and r.output[0].content[0].type == "output_text"
    # usage counts exactly the chat prompt the request translates to
    assert r.usage.input_tokens == _count(server, [{"role": "system", "content": "Answer in one word."},
                                                   {"role": "user", "content": "Name a colour."}])
    assert 0 < r.usage.output_tokens <= 12
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens

    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-5:] == ["response.output_text.delta", "response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{r.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text  # greedy: the stream reassembles to the plain reply
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == r.usage.output_tokens


def test_function_call_then_function_call_output(client, model, server):
    r = client.responses.create(model=model, input="What is the weather in Paris?", tools=[WEATHER_TOOL],
                                tool_choice="required", parallel_tool_calls=False, max_output_tokens=48,
                                temperature=0)
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1, r.output
    call = calls[0]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_TOOL["parameters"])

    # the same call streamed: the item, its argument deltas, done events
    events = list(client.responses.create(model=model, input="What is the weather in Paris?", stream=True,
                                          tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False,
                                          max_output_tokens=48, temperature=0))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["function_call"] and added[0].item.name == "get_weather"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == done[0].arguments == call.arguments
    assert events[-1].type == "response.completed"

    # the round trip: the call and its output go back as items; no call allowed now, so the model answers
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."}]
    r2 = client.responses.create(model=model, input=history, tools=[WEATHER_TOOL], tool_choice="none",
                                 max_output_tokens=16, temperature=0)
    assert [item.type for item in r2.output] == ["message"] and r2.output_text
    # the prompt held the call and its result (rendered as the chat route renders them)
    chat_history = [history[0],
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": call.call_id, "type": "function",
                         "function": {"name": call.name, "arguments": json.loads(call.arguments)}}]},
                    {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C."}]
    tok = httpx.post(server.url + "/tokenize", json={"messages": chat_history, "tools": [
        {"type": "function", "function": {k: v for k, v in WEATHER_TOOL.items() if k != "type"}}]}, timeout=60)
    assert r2.usage.input_tokens == tok.json()["count"]


def test_named_tool_choice_and_item_input(client, model):
    add = {"type": "function", "name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}
    r = client.responses.create(
        model=model, tools=[WEATHER_TOOL, add], tool_choice={"type": "function", "name": "add"},
        parallel_tool_calls=False, max_output_tokens=48, temperature=0,
        input=[{"type": "message", "role": "developer", "content": "You are a calculator."},
               {"role": "user", "content": [{"type": "input_text", "text": "What is 2 + 3?"}]}])
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "add"
    jsonschema.validate(json.loads(call.arguments), add["parameters"])
    assert r.tool_choice.name == "add"


def test_text_format_json_schema_is_valid_json(client, model):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.responses.create(model=model, input="Invent a person.", max_output_tokens=64, temperature=0,
                                text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                 "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_previous_response_id_continues_the_conversation(client, model, server):
    r1 = client.responses.create(model=model, input="My name is Ada.", instructions="Be brief.",
                                 max_output_tokens=8, temperature=0)
    r2 = client.responses.create(model=model, input="What is my name?", previous_response_id=r1.id,
                                 max_output_tokens=8, temperature=0)
    assert r2.previous_response_id == r1.id
    # the history came back whole (instructions are not carried over, as OpenAI's)
    expected = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": r1.output_text},
                {"role": "user", "content": "What is my name?"}]
    assert r2.usage.input_tokens == _count(server, expected)

    assert client.responses.retrieve(r1.id).output_text == r1.output_text
    client.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r1.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="again", previous_response_id=r1.id, max_output_tokens=4)
    r3 = client.responses.create(model=model, input="hi", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r3.id)


def test_output_text_logprobs(client, model):
    kw = dict(model=model, input="Name a colour.", max_output_tokens=6, temperature=0, top_logprobs=2,
              include=["message.output_text.logprobs"])
    r = client.responses.create(**kw)
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens and "".join(lp.token for lp in lps) == r.output_text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in lps)
    events = list(client.responses.create(stream=True, **kw))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(lp.token, round(lp.logprob, 4)) for lp in streamed] == [(lp.token, round(lp.logprob, 4)) for lp in lps]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert len(done.logprobs) == len(lps)
    with pytest.raises(openai.BadRequestError):  # the tokens would be split between text and calls
        client.responses.create(tools=[WEATHER_TOOL], **kw)


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-nonexistent", input="hi", max_output_tokens=4)


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"prompt_cache_key": "k"}, "prompt_cache_key"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_unsupported_fields_are_400s_naming_them(server, model, extra, param):
    body = {"model": model, "input": "hi", **extra}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"] or "").startswith(param), err
