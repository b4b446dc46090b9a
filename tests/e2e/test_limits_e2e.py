"""Request limits on a real HTTP server (uvicorn in a thread, the fake engine): body size (413), fan-out (400),
X-Request-Id (400), admission (503 + Retry-After, and the slots come back however a request ends), each seen
through the official `openai` client's error classes where it can send the request, raw httpx where it cannot."""

from __future__ import annotations

import concurrent.futures
import socket
import time

import httpx
import openai
import pytest

from tests.helpers import background_server
from tests.unit.fake_engine import FakeEngine
from tokenspout.entrypoints.openai.limits import ServerLimits
from tokenspout.entrypoints.openai.protocol.bounds import RequestBounds

LIMITS = ServerLimits(max_body_bytes=4096, max_fanout=8, max_queued_requests=2, running_capacity=2,
                      max_header_bytes=2048)


@pytest.fixture(scope="module")
def engine():
    return FakeEngine(token_delay=0.02)


@pytest.fixture(scope="module")
def server(engine):
    with background_server(engine, limits=LIMITS) as srv:
        yield srv


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def wait_idle(server, timeout: float = 10.0) -> None:
    """Every admission slot back (the gate counts engine requests of admitted API requests)."""
    end = time.monotonic() + timeout
    gate = None
    while time.monotonic() < end:
        gate = server.server.config.app.state.server.gate
        if gate.in_flight == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"admission slots not released: {gate.in_flight if gate else '?'} in flight")


def test_a_body_over_the_limit_is_413_before_it_is_parsed(server, engine):
    c = client(server)
    with pytest.raises(openai.APIStatusError) as exc:
        c.completions.create(model=engine.model_name, prompt="x" * 5000, max_tokens=1)
    assert exc.value.status_code == 413
    assert "--max-request-body-bytes" in exc.value.body["message"] and exc.value.body["code"] == 413
    # under the limit the same route answers
    assert c.completions.create(model=engine.model_name, prompt="x" * 100, max_tokens=1).choices
    # a chunked body (no Content-Length) is cut while it is read
    def chunks():
        yield b'{"model": "' + engine.model_name.encode() + b'", "prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'
    with httpx.Client(base_url=server.url, timeout=30) as h:
        r = h.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["type"] == "RequestTooLargeError"
    # a lying Content-Length on a raw socket: refused before the body arrives (nothing is sent after the headers)
    with socket.create_connection((server.host, server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 999999999\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 413")
    wait_idle(server)


def test_headers_over_the_limit_are_431_naming_the_flag(server, engine):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, default_headers={"X-Big": "a" * 3000})
    with pytest.raises(openai.APIStatusError) as exc:
        c.completions.create(model=engine.model_name, prompt="hi", max_tokens=1)
    assert exc.value.status_code == 431 and "--max-request-header-bytes" in exc.value.body["message"]
    many = {f"X-H{i}": "v" for i in range(400)}  # many small headers add up the same way
    assert httpx.get(server.url + "/health", headers=many).status_code == 431
    assert httpx.get(server.url + "/health", headers={"X-Small": "a" * 500}).status_code == 200


def test_fanout_over_the_limit_is_400_naming_the_flag(server, engine):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as exc:
        c.completions.create(model=engine.model_name, prompt=["a", "b", "c"], n=3, max_tokens=1)
    assert "9 completions" in exc.value.body["message"] and "--max-request-fanout" in exc.value.body["message"]
    out = c.completions.create(model=engine.model_name, prompt=["a", "b"], n=4, max_tokens=1)  # exactly 8
    assert len(out.choices) == 8
    wait_idle(server)


def test_request_id_header_is_bounded_and_printable(server, engine):
    with httpx.Client(base_url=server.url, timeout=30) as h:
        assert h.get("/v1/models", headers={"X-Request-Id": "r" * 256}).headers["x-request-id"] == "r" * 256
        for bad in ("r" * 257, "a\tb"):
            r = h.get("/v1/models", headers={"X-Request-Id": bad})
            assert r.status_code == 400 and "X-Request-Id" in r.json()["error"]["message"]


def test_admission_rejects_past_the_queue_at_once_and_every_slot_comes_back(server, engine):
    """running_capacity 2 + 2 queued = 4 engine requests in flight at most: a fifth gets a 503 with Retry-After at
    once (not after a wait); admitted requests complete; slots come back after streams, errors and disconnects."""
    c = client(server)
    slow = dict(model=engine.model_name, prompt="hold", max_tokens=60, extra_body={"ignore_eos": True})
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        held = [pool.submit(c.completions.create, **slow) for _ in range(2)]  # 2 x n=1
        held.append(pool.submit(c.completions.create, n=2, **slow))  # 2 more: the gate is full (4)
        gate = server.server.config.app.state.server.gate
        end = time.monotonic() + 10
        while gate.in_flight < 4 and time.monotonic() < end:
            time.sleep(0.01)
        assert gate.in_flight == 4
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as exc:
            c.completions.create(model=engine.model_name, prompt="one more", max_tokens=1)
        assert exc.value.status_code == 503 and time.monotonic() - t0 < 2.0
        assert exc.value.response.headers["retry-after"] == "1"
        assert "--max-queued-requests" in exc.value.body["message"]
        assert all(len(f.result().choices) >= 1 for f in held)  # every admitted request completes
    wait_idle(server)
    # a stream the client abandons half-way gives its slot back
    with httpx.Client(base_url=server.url, timeout=30) as h:
        with h.stream("POST", "/v1/completions", json={**{k: v for k, v in slow.items() if k != "extra_body"},
                                                        "stream": True, "ignore_eos": True}) as r:
            assert r.status_code == 200
            next(r.iter_lines())
    wait_idle(server)
    # a request refused by the engine (bad input) gives its slot back too
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=engine.model_name, prompt=[[VOCAB_OUTSIDE]], max_tokens=1)
    wait_idle(server)
    assert c.completions.create(model=engine.model_name, prompt="after", max_tokens=1).choices


VOCAB_OUTSIDE = 10**6


@pytest.fixture(scope="module")
def roomy(engine):
    """The default limits (8 MiB bodies): the list bounds are met before the body limit."""
    with background_server(engine) as srv:
        yield srv


def nested_schema(levels: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(levels):
        s = {"type": "object", "properties": {"a": s}}
    return s


@pytest.mark.parametrize("field,value,message", [
    ("stop", ["x"] * 65, "at most 64 entries, got 65 (--max-request-stop)"),
    ("bad_words", ["w"] * 1025, "at most 1024 entries, got 1025 (--max-request-list-entries)"),
    ("guided_choice", ["c"] * 1025, "at most 1024 entries"),
    ("stop_token_ids", [5] * 1025, "at most 1024 entries"),
    ("logit_bias", {str(i): 1.0 for i in range(1025)}, "at most 1024 entries"),
    ("guided_json", nested_schema(40), "nested deeper than 64 levels (--max-request-json-depth)"),
    ("messages", [{"role": "user", "content": "hi"}] * 4097, "at most 4096 entries, got 4097 (--max-request-messages)"),
])
def test_lists_and_nesting_are_bounded_with_a_400_naming_the_field(roomy, engine, field, value, message):
    """Each bound a 400 that names the field; the largest allowed size of each is accepted."""
    c = client(roomy)
    base = {"model": engine.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(**{**base, "extra_body": {field: value}} if field != "messages" else
                                  {**base, "messages": value})
    assert exc.value.body["param"] == field and message in exc.value.body["message"], exc.value.body
    within = {"stop": ["x"] * 64, "bad_words": ["w"] * 1024, "guided_json": nested_schema(30)}
    if field in within:
        assert c.chat.completions.create(**base, extra_body={field: within[field]}).choices
    wait_idle(roomy)


def test_the_bounds_are_the_servers_flags(engine):
    """A server started with other bounds applies them (the request models read the server's RequestBounds), in
    both directions, while another server in the same process keeps the defaults."""
    tight = ServerLimits(bounds=RequestBounds(stop=2, token_list=3, messages=2, tools=1, json_depth=4))
    roomy_bounds = ServerLimits(bounds=RequestBounds(stop=100, token_list=2000))
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with background_server(engine, limits=tight) as t, background_server(engine, limits=roomy_bounds) as r:
        ct, cr = client(t), client(r)
        for extra, param in (({"stop": ["a", "b", "c"]}, "stop"), ({"bad_words": ["a"] * 4}, "bad_words"),
                             ({"structured_outputs": {"choice": ["a"] * 4}}, "structured_outputs"),
                             ({"guided_json": nested_schema(3)}, "guided_json")):
            with pytest.raises(openai.BadRequestError) as exc:
                ct.chat.completions.create(model=engine.model_name, **base, extra_body=extra)
            assert exc.value.body["param"] == param and "--max-request-" in exc.value.body["message"], exc.value.body
        with pytest.raises(openai.BadRequestError) as exc:
            ct.chat.completions.create(model=engine.model_name, max_tokens=1,
                                       messages=[{"role": "user", "content": "hi"}] * 3)
        assert "--max-request-messages" in exc.value.body["message"]
        r_tok = httpx.post(t.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}] * 3})
        assert r_tok.status_code == 400 and "--max-request-messages" in r_tok.text
        assert ct.chat.completions.create(model=engine.model_name, **base, extra_body={"stop": ["a", "b"]}).choices
        # past the defaults, within the roomy server's flags
        assert cr.chat.completions.create(model=engine.model_name, **base,
                                          extra_body={"stop": ["x"] * 100, "bad_words": ["w"] * 2000}).choices


def test_tokenizing_a_huge_prompt_does_not_stall_the_event_loop(engine):
    """/tokenize of a 16 MB prompt (the fake engine tokenizes in Python, ~3 s) runs on the preparation worker: the
    loop keeps answering /health meanwhile (on the loop it answered none until the prompt was done)."""
    big = ServerLimits(max_body_bytes=64 << 20)
    with background_server(engine, limits=big) as srv, httpx.Client(base_url=srv.url, timeout=120) as h, \
            httpx.Client(base_url=srv.url, timeout=120) as probe, concurrent.futures.ThreadPoolExecutor(1) as pool:
        heavy = pool.submit(h.post, "/tokenize", json={"prompt": "ab" * 8_000_000})
        time.sleep(0.3)  # the body is sent and being tokenized
        answered, worst = 0, 0.0
        while not heavy.done():
            t0 = time.monotonic()
            assert probe.get("/health").status_code == 200
            worst = max(worst, time.monotonic() - t0)
            answered += 1 if not heavy.done() else 0
            time.sleep(0.02)
        assert heavy.result().json()["count"] == 16_000_000
        assert answered >= 10, (answered, worst)
