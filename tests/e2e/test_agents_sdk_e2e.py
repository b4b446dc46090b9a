"""The `openai-agents` SDK, unchanged, runs a tool loop against tokenspout through the Responses API: an Agent with
a function_tool, the SDK's OpenAIResponsesModel pointed at a server started as `make serve` starts it (the default
model and its own template, no --chat-template), Runner.run.

Turn 1 is forced to call the tool (tool_choice "required": grammar-constrained, so a valid call whatever the tiny
model would say); the SDK runs the tool with the model's arguments and sends its output back as a
function_call_output item; it then resets tool_choice (its default), and with `tool_use_behavior` the default
("run_llm_again") the model answers in turn 2.  Every request body the SDK sent is recorded (an httpx event hook).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

WEATHER = "Sunny, 21 degrees Celsius."
CALLS: list[str] = []


@function_tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    CALLS.append(city)
    return WEATHER


@pytest.fixture(scope="module")
def server():
    """The default model as `make serve` serves it: its own chat template (which never renders tools) and no
    --chat-template; requests with tools get the bundled ChatML tools template (README, Tool calling)."""
    from tests.helpers import background_server, real_engine

    with real_engine() as engine, background_server(engine) as srv:
        yield srv


def test_the_default_server_takes_tools(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=client.models.list().data[0].id, messages=ask, tools=tools,
                                       tool_choice="required", parallel_tool_calls=False, max_tokens=48,
                                       temperature=0)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    # /tokenize counts the prompt the chat route rendered (the tools template, with the tools in it)
    tok = httpx.post(server.url + "/tokenize", json={"messages": ask, "tools": tools}, timeout=60).json()
    assert tok["count"] == r.usage.prompt_tokens
    plain = httpx.post(server.url + "/tokenize", json={"messages": ask}, timeout=60).json()
    assert tok["count"] > plain["count"] + 20  # the tools' signatures are in the prompt


def test_agent_tool_loop_through_the_responses_api(server):
    set_tracing_disabled(True)  # no tracing exporter: nothing may try to reach the network
    sent: list[dict] = []

    async def record(request: httpx.Request) -> None:
        if request.url.path.endswith("/responses"):
            sent.append(json.loads(request.read()))

    async def run():
        http = httpx.AsyncClient(event_hooks={"request": [record]}, timeout=120)
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, http_client=http)
        model_name = (await client.models.list()).data[0].id
        agent = Agent(
            name="weather", instructions="You answer questions about the weather.", tools=[get_weather],
            model=OpenAIResponsesModel(model=model_name, openai_client=client),
            model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                         max_tokens=48),
        )
        try:
            return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        finally:
            await http.aclose()

    CALLS.clear()
    result = asyncio.run(run())
    # the tool ran once, with the model's arguments
    assert len(CALLS) == 1 and isinstance(CALLS[0], str)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert kinds[-1] == "message_output_item", kinds
    assert isinstance(result.final_output, str) and result.final_output
    # turn 1 forced the call; turn 2 carried the call and its output back as items
    assert len(sent) == 2, [s.get("tool_choice") for s in sent]
    assert sent[0]["tool_choice"] == "required" and sent[0]["tools"][0]["name"] == "get_weather"
    items = sent[1]["input"]
    call = next(i for i in items if i.get("type") == "function_call")
    output = next(i for i in items if i.get("type") == "function_call_output")
    assert call["name"] == "get_weather" and output["call_id"] == call["call_id"] and output["output"] == WEATHER


def test_agent_tool_loop_streamed(server):
    """The same loop through Runner.run_streamed: the SDK reads tokenspout's Responses event stream (items,
    argument deltas, response.completed) for both turns."""
    set_tracing_disabled(True)

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        model_name = (await client.models.list()).data[0].id
        agent = Agent(
            name="weather", instructions="You answer questions about the weather.", tools=[get_weather],
            model=OpenAIResponsesModel(model=model_name, openai_client=client),
            model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                         max_tokens=48),
        )
        result = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
        kinds = [event.type async for event in result.stream_events()]
        return result, kinds

    CALLS.clear()
    result, kinds = asyncio.run(run())
    assert len(CALLS) == 1
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    items = [item.type for item in result.new_items]
    assert items[:2] == ["tool_call_item", "tool_call_output_item"] and items[-1] == "message_output_item", items
    assert isinstance(result.final_output, str) and result.final_output
