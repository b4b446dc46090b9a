"""The Ray Serve replica-picking rule (ray_routing.py) and the in-process ASGI forwarding (ray_asgi.py), without Ray:
prefix affinity unless the preferred replica is busier than min + max(2, min / 8), else the least loaded; the
forwarded request gets the same answers as the app itself (status, JSON errors, SSE), and closing the forward early
aborts the request."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.unit.fake_engine import FakeEngine
from tokenspout.entrypoints.ray_asgi import ForwardedRequest, run_asgi
from tokenspout.entrypoints.ray_routing import AFFINITY_CHARS, AffinityRule, affinity_key, prompt_prefix


def chat(text: str, system: str = "You are helpful.") -> bytes:
    return json.dumps({"messages": [{"role": "system", "content": system}, {"role": "user", "content": text}],
                       "max_tokens": 4}).encode()


def test_key_is_the_prompt_prefix():
    assert affinity_key(chat("a")) == affinity_key(chat("a"))
    assert affinity_key(chat("a")) != affinity_key(chat("b"))
    assert affinity_key(chat("a", system="x")) != affinity_key(chat("a", system="y"))
    long_system = "s" * AFFINITY_CHARS  # the first AFFINITY_CHARS characters decide: a long shared preamble
    assert affinity_key(chat("a", long_system)) == affinity_key(chat("b", long_system))
    assert prompt_prefix({"prompt": "hello"}) == "hello"
    assert prompt_prefix({"prompt": ["first", "second"]}) == "first"
    assert prompt_prefix({"prompt": list(range(100))}) == str(list(range(64)))
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prompt_prefix(parts) == "user\x00hi\x00"
    for body in (b"", b"not json", b"[1, 2]", b'{"model": "x"}', b"\xff\xfe"):
        assert affinity_key(body) is None  # unreadable or no prompt: the least loaded replica, which answers it


def test_rule_keeps_affinity_until_the_preferred_replica_is_too_busy():
    rule = AffinityRule()
    assert rule.pick("k", {"a": 0, "b": 0}) == "a"  # unknown key: least loaded (first of equals)
    rule.record("k", "b")
    assert rule.pick("k", {"a": 0, "b": 2}) == "b"  # 2 <= 0 + max(2, 0)
    assert rule.pick("k", {"a": 0, "b": 3}) == "a"  # 3 > 0 + 2: too busy
    assert rule.pick("k", {"a": 40, "b": 45}) == "b"  # 45 <= 40 + max(2, 5)
    assert rule.pick("k", {"a": 40, "b": 46}) == "a"
    assert rule.pick("k", {"a": 5}) == "a"  # the preferred replica is not a candidate (gone, or full)
    assert rule.pick(None, {"a": 3, "b": 1, "c": 1}) == "b"
    assert rule.ranked("k", {"a": 0, "b": 1, "c": 5}) == ["b", "a", "c"]
    assert rule.ranked("k", {"a": 0, "b": 9, "c": 5}) == ["a", "c", "b"]


def test_rule_forgets_a_lost_replica_and_bounds_its_memory():
    rule = AffinityRule(max_entries=3)
    rule.record("k", "b")
    rule.forget("b")
    assert rule.pick("k", {"a": 1, "b": 0, "c": 0}) == "b"  # by load now, not by memory
    rule.record("k", "c")
    assert rule.pick("k", {"a": 0, "b": 0, "c": 1}) == "c"
    for i in range(3):
        rule.record(f"other{i}", "a")
    assert rule.pick("k", {"a": 0, "b": 0, "c": 1}) == "a"  # the oldest key was evicted
    rule.record(None, "a")  # no key: nothing to remember


def test_rule_spreads_a_shared_prefix_within_the_slack():
    """Many requests with one key (a shared system prompt) still spread: the preferred replica takes at most
    max(2, min / 8) more than the least loaded."""
    rule = AffinityRule()
    loads = {"a": 0, "b": 0}
    for _ in range(200):
        r = rule.pick("shared", loads)
        rule.record("shared", r)
        loads[r] += 1
    assert abs(loads["a"] - loads["b"]) <= max(2, min(loads.values()) // 8) + 1


async def collect(app, req: ForwardedRequest) -> tuple[int, dict[bytes, bytes], bytes]:
    items = [item async for item in run_asgi(app, req, [(b"x-replica", b"r1")])]
    status, headers = items[0]
    return status, dict(headers), b"".join(items[1:])


@pytest.fixture
def fake_app():
    from tokenspout.entrypoints.openai.api_server import build_app

    engine = FakeEngine()
    return engine, build_app(engine)


async def test_forwarded_requests_get_the_apps_answers(fake_app):
    _, app = fake_app
    json_headers = [(b"content-type", b"application/json")]
    status, headers, body = await collect(app, ForwardedRequest("GET", "/v1/models"))
    assert status == 200 and headers[b"x-replica"] == b"r1" and json.loads(body)["data"][0]["id"]
    # greedy: the fake engine's unseeded sampling ends a reply at its first token 4% of the time (an empty answer)
    greedy = json.dumps({**json.loads(chat("hi")), "temperature": 0}).encode()
    status, _, body = await collect(app, ForwardedRequest("POST", "/v1/chat/completions", headers=json_headers,
                                                          body=greedy))
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"]
    bad = json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": -1}).encode()
    status, _, body = await collect(app, ForwardedRequest("POST", "/v1/chat/completions", headers=json_headers,
                                                          body=bad))
    assert status == 400 and json.loads(body)["error"]["param"] == "temperature"
    stream = json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "stream": True}).encode()
    status, headers, body = await collect(app, ForwardedRequest("POST", "/v1/chat/completions",
                                                                headers=json_headers, body=stream))
    assert status == 200 and headers[b"content-type"].startswith(b"text/event-stream")
    assert body.endswith(b"data: [DONE]\n\n") and body.count(b"data: ") >= 3


async def test_closing_the_forward_early_aborts_the_request(fake_app):
    engine, app = fake_app
    engine.token_delay = 0.02
    body = json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 500, "ignore_eos": True,
                       "stream": True}).encode()
    forward = run_asgi(app, ForwardedRequest("POST", "/v1/chat/completions",
                                             headers=[(b"content-type", b"application/json")], body=body))
    head = await forward.__anext__()
    assert head[0] == 200
    await forward.__anext__()  # the first frame
    await forward.aclose()  # the ingress lets go (its client disconnected)
    for _ in range(100):  # the app's SSE response sees the disconnect and closes the engine's generator
        if engine.records and all(r.outcome != "running" for r in engine.records.values()):
            break
        await asyncio.sleep(0.02)
    # "closed": the generator was closed early, what the real AsyncLLM turns into an abort in the engine
    assert engine.records and all(r.outcome in ("aborted", "closed") for r in engine.records.values()), engine.records
