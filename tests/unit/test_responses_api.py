"""/v1/responses pieces that need no model: the store's bounds, input items → chat messages, and reasoning items
(the fake engine behind --reasoning-parser deepseek_r1, whose reply without </think> is all reasoning)."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

from tests.helpers import sse_events
from tests.unit.fake_engine import FakeEngine
from tokenspout.entrypoints.openai.api_server import build_app
from tokenspout.entrypoints.openai.protocol.responses import ResponsesRequest
from tokenspout.entrypoints.openai.responses_store import ResponseStore
from tokenspout.entrypoints.openai.serving_responses import input_messages


def test_store_is_bounded_by_count_and_bytes():
    store = ResponseStore(max_responses=2, max_bytes=1000)
    for i in range(3):
        assert store.put(f"r{i}", "{}", [{"role": "user", "content": "x"}])
    assert len(store) == 2 and store.get("r0") is None  # the oldest went first
    store.get("r1")  # used: now the most recent
    store.put("r3", "{}", [])
    assert store.get("r1") is not None and store.get("r2") is None
    assert not store.put("big", "x" * 2000, [])  # alone over the byte bound: not stored
    store.put("r4", "y" * 980, [])
    assert store.num_bytes <= 1000 and list(store._entries) == ["r4"]
    assert store.delete("r4") and not store.delete("r4") and store.num_bytes == 0


def test_input_items_become_chat_messages():
    req = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "let me look", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\":1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
    ]})
    assert input_messages(req) == [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "let me look", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"x\":1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]


def test_reasoning_items_plain_and_streamed():
    client = TestClient(build_app(FakeEngine(), reasoning_parser="deepseek_r1"))
    body = {"input": "think", "max_output_tokens": 6, "temperature": 0}
    r = client.post("/v1/responses", json=body).json()
    assert [item["type"] for item in r["output"]] == ["reasoning"]
    reasoning = r["output"][0]["content"][0]
    assert reasoning["type"] == "reasoning_text" and reasoning["text"]
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}

    events = sse_events(client.post("/v1/responses", json={**body, "stream": True}).text)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert events[2]["item"]["type"] == "reasoning"
    assert kinds[-3:] == ["response.reasoning_text.done", "response.output_item.done", "response.incomplete"]
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert streamed == reasoning["text"] == events[-3]["text"]
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == streamed
    # the item the cut went through is "incomplete" in its output_item.done as in the response (was "completed")
    assert events[-2]["item"]["status"] == r["output"][0]["status"] == "incomplete"
    assert events[-1]["response"]["output"][0]["status"] == "incomplete"


def test_stream_error_before_the_first_event_is_a_json_error():
    client = TestClient(build_app(FakeEngine(max_model_len=64)))
    r = client.post("/v1/responses", json={"input": "x" * 200, "stream": True})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["param"] == "input" and "context" in r.json()["error"]["message"]


def test_an_engine_death_mid_stream_ends_with_an_error_event():
    """Responses: an `error` event (next in the sequence) ends the stream; Anthropic: its `error` event."""
    for route, body in (("/v1/responses", {"input": "hi", "max_output_tokens": 50}),
                        ("/v1/messages", {"model": "fake-model", "max_tokens": 50,
                                          "messages": [{"role": "user", "content": "hi"}]})):
        engine = FakeEngine(token_delay=0.02)
        client = TestClient(build_app(engine))
        lines: list[str] = []
        with client.stream("POST", route, json={**body, "stream": True, "temperature": 0}) as r:
            for line in r.iter_lines():
                lines.append(line)
                if sum(x.startswith("data: ") for x in lines) == 4:
                    engine.kill()
        data = [json.loads(x.removeprefix("data: ")) for x in lines if x.startswith("data: ")]
        assert data[-1]["type"] == "error", data[-1]
        if route == "/v1/responses":
            assert [d["sequence_number"] for d in data] == list(range(len(data)))
            assert "dead" in data[-1]["message"]
        else:
            assert data[-1]["error"]["type"] == "api_error"
