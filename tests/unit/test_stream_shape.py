"""Stream chunks as vLLM and OpenAI shape them (vLLM-test findings), on the fake engine: the finish_reason rides on
the last token's chunk, continuous_usage_stats counts no token on the role chunk, and return_token_ids' fields are
left out of chunks that carry none (never null)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from tests.unit.fake_engine import FakeEngine
from tokenspout.entrypoints.openai.api_server import build_app


@pytest.fixture(scope="module")
def client():
    return TestClient(build_app(FakeEngine()))


def _chunks(text: str) -> list[dict]:
    frames = [f.removeprefix("data: ") for f in text.strip().split("\n\n")]
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0, "stream": True,
        "ignore_eos": True}
COMPLETION = {"prompt": "hi", "max_tokens": 5, "temperature": 0, "stream": True, "ignore_eos": True}


@pytest.mark.parametrize("route, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_finish_reason_is_on_the_last_tokens_chunk(client, route, body):
    chunks = [c for c in _chunks(client.post(route, json=body).text) if c["choices"]]
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "length"
    assert (last["delta"]["content"] if route.endswith("chat/completions") else last["text"])  # not an empty one
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert len(chunks) == 5 + route.endswith("chat/completions")  # one per token (+ the role chunk)


def test_continuous_usage_counts_no_token_on_the_role_chunk(client):
    body = {**CHAT, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = _chunks(client.post("/v1/chat/completions", json=body).text)
    role, tokens = chunks[0], [c for c in chunks[1:] if c["choices"]]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["usage"]["completion_tokens"] == 0 and role["usage"]["total_tokens"] == role["usage"]["prompt_tokens"]
    assert [c["usage"]["completion_tokens"] for c in tokens] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("route, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
@pytest.mark.parametrize("continuous", [False, True])
def test_return_token_ids_fields_are_left_out_not_null(client, route, body, continuous):
    body = {**body, "return_token_ids": True}
    if continuous:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    chunks = [c for c in _chunks(client.post(route, json=body).text) if c["choices"]]
    assert chunks[0]["prompt_token_ids"] if route.endswith("chat/completions") else \
        chunks[0]["choices"][0]["prompt_token_ids"]
    for c in chunks:
        for obj in (c, *c["choices"]):
            for key in ("token_ids", "prompt_token_ids"):
                assert obj.get(key, "absent") is not None, (key, c)
    generated = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
    assert len(generated) == 5
    plain = client.post(route, json={**body, "return_token_ids": False, "stream_options": None}).text
    assert "token_ids" not in plain


def test_extra_message_keys_reach_the_template():
    """vLLM-test finding: keys beyond OpenAI's inside a message were a 400; vLLM hands them to the template."""
    seen: list[list[dict]] = []

    class Recording(FakeEngine):
        def apply_chat_template(self, messages, add_generation_prompt=True, **kw):
            seen.append(messages)
            return super().apply_chat_template(messages, add_generation_prompt, **kw)

    client = TestClient(build_app(Recording()))
    messages = [{"role": "user", "content": "hi", "foo": {"bar": [1, 2]}},
                {"role": "assistant", "content": "ok", "reasoning_content": "because"},
                {"role": "user", "content": "again"}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert seen[-1][0]["foo"] == {"bar": [1, 2]} and seen[-1][1]["reasoning_content"] == "because"
    r = client.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200 and seen[-1][0]["foo"] == {"bar": [1, 2]}
    # still bounded: nesting past the limit is a 400
    deep: dict = {}
    node = deep
    for _ in range(80):
        node["x"] = {}
        node = node["x"]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi", "deep": deep}]})
    assert r.status_code == 400


def test_invocations_routes_by_body():
    client = TestClient(build_app(FakeEngine()))
    chat = client.post("/invocations", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    completion = client.post("/invocations", json={"prompt": "hi", "max_tokens": 3})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    streamed = client.post("/invocations", json={"prompt": "hi", "max_tokens": 3, "stream": True})
    assert streamed.text.rstrip().endswith("data: [DONE]")
    for body in ({"max_tokens": 3}, {"prompt": "x", "messages": []}, [1]):
        assert client.post("/invocations", json=body).status_code == 400
    r = client.post("/invocations", json={"prompt": "hi", "bogus": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bogus"


def test_server_wide_usage_and_token_id_flags():
    client = TestClient(build_app(FakeEngine(), force_include_usage=True, return_tokens_as_token_ids=True))
    chunks = _chunks(client.post("/v1/chat/completions", json={**CHAT, "logprobs": True}).text)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    tokens = [t["token"] for c in chunks if c["choices"] for t in (c["choices"][0]["logprobs"] or {}).get(
        "content") or []]
    assert len(tokens) == 5 and all(t.startswith("token_id:") for t in tokens)
    # a request that says otherwise wins
    r = client.post("/v1/completions", json={**COMPLETION, "stream": False, "logprobs": 0,
                                             "return_tokens_as_token_ids": False}).json()
    assert not any(t.startswith("token_id:") for t in r["choices"][0]["logprobs"]["tokens"])
    plain = TestClient(build_app(FakeEngine()))
    assert all(c["choices"] for c in _chunks(plain.post("/v1/chat/completions", json=CHAT).text))


def test_uds_and_root_path(tmp_path):
    """--uds serves on a Unix socket; --root-path is the prefix a proxy strips (the routes answer without it,
    and /openapi.json names it)."""
    import threading
    import time

    import httpx
    import uvicorn

    sock = str(tmp_path / "tokenspout.sock")
    server = uvicorn.Server(uvicorn.Config(build_app(FakeEngine()), uds=sock, root_path="/llm",
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        with httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://localhost") as c:
            assert c.get("/health").status_code == 200
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["choices"]
            assert c.get("/openapi.json").json()["servers"] == [{"url": "/llm"}]
    finally:
        server.should_exit = True
        thread.join(timeout=20)
