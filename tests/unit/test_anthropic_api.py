"""/v1/messages pieces that need no model: content blocks → chat messages, thinking blocks (the fake engine behind
--reasoning-parser deepseek_r1, whose reply without </think> is all reasoning), the stream's event order, and
Anthropic's error shape before the first event."""

from __future__ import annotations

from fastapi.testclient import TestClient

from tests.helpers import sse_events
from tests.unit.fake_engine import FakeEngine
from tokenspout.entrypoints.anthropic.protocol import MessagesRequest
from tokenspout.entrypoints.anthropic.serving_messages import chat_body
from tokenspout.entrypoints.openai.api_server import build_app


def test_blocks_become_chat_messages():
    req = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "Be brief."}],
        "stop_sequences": ["END"], "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, "thinking": {"type": "disabled"},
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": ""},
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}, "caller": {"type": "direct"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "42"}]},
                {"type": "tool_result", "tool_use_id": "t2", "content": "boom", "is_error": True},
                {"type": "text", "text": "thanks"}]},
        ]})
    body = chat_body(req)
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "calling", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "42"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: boom"},
        {"role": "user", "content": "thanks"},
    ]
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert body["stop"] == ["END"] and body["max_tokens"] == 8
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def test_thinking_blocks_plain_and_streamed():
    client = TestClient(build_app(FakeEngine(), reasoning_parser="deepseek_r1"))
    body = {"model": "fake-model", "max_tokens": 6, "temperature": 0, "thinking": {"type": "enabled",
                                                                                    "budget_tokens": 1024},
            "messages": [{"role": "user", "content": "think"}]}
    m = client.post("/v1/messages", json=body).json()
    assert [b["type"] for b in m["content"]] == ["thinking"] and m["content"][0]["thinking"]
    assert m["stop_reason"] == "max_tokens" and m["usage"]["output_tokens"] == 6

    events = sse_events(client.post("/v1/messages", json={**body, "stream": True}).text)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert events[2]["content_block"]["type"] == "thinking"
    streamed = "".join(e["delta"]["thinking"] for e in events if e["type"] == "content_block_delta")
    assert streamed == m["content"][0]["thinking"]
    assert events[-2]["delta"]["stop_reason"] == "max_tokens" and events[-2]["usage"]["output_tokens"] == 6
    assert events[0]["message"]["usage"]["input_tokens"] == m["usage"]["input_tokens"]


def test_errors_before_the_first_event_are_in_anthropics_shape():
    client = TestClient(build_app(FakeEngine(max_model_len=64)))
    body = {"model": "fake-model", "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 200}]}
    for stream in (False, True):
        r = client.post("/v1/messages", json={**body, "stream": stream})
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = client.post("/v1/messages", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # the other routes keep OpenAI's shape
    r = client.post("/v1/chat/completions", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "type" not in r.json() and r.json()["error"]["code"] == 400


def test_too_large_bodies_are_413s_in_anthropics_shape():
    from tokenspout.entrypoints.openai.limits import ServerLimits

    client = TestClient(build_app(FakeEngine(), limits=ServerLimits(max_body_bytes=1000)))
    body = {"model": "fake-model", "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 2000}]}
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = client.post("/v1/chat/completions", json={"messages": body["messages"]})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_the_agent_routes_honour_the_request_bound_flags():
    """--max-request-messages / -tools / -stop bound /v1/responses and /v1/messages too (400s naming the flag)."""
    from tokenspout.entrypoints.openai.limits import ServerLimits
    from tokenspout.entrypoints.openai.protocol.bounds import RequestBounds

    client = TestClient(build_app(FakeEngine(), limits=ServerLimits(bounds=RequestBounds(messages=2, stop=1))))
    three = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    r = client.post("/v1/responses", json={"input": three, "max_output_tokens": 2})
    assert r.status_code == 400 and "--max-request-messages" in r.json()["error"]["message"]
    r = client.post("/v1/messages", json={"model": "fake-model", "max_tokens": 2, "messages": three})
    assert r.status_code == 400 and "--max-request-messages" in r.json()["error"]["message"]
    r = client.post("/v1/messages", json={"model": "fake-model", "max_tokens": 2, "messages": three[:1],
                                          "stop_sequences": ["x", "y"]})
    assert r.status_code == 400 and "--max-request-stop" in r.json()["error"]["message"]
    assert client.post("/v1/responses", json={"input": three[:2], "max_output_tokens": 2}).status_code == 200
