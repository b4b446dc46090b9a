"""--data-parallel-size 2 behind one server (two real engine processes, one thread each), through the openai
client: requests spread over both engines and all succeed with the same greedy text as one engine gives; aborts
(client disconnects) reach the engine that holds the request; /metrics has per-engine series and totals; killing
one engine's process ends only its requests (with an error), /health turns 503 and the other engine keeps
serving."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time

import httpx
import openai
import pytest

from tests.helpers import background_server, real_engine

pytestmark = pytest.mark.slow
MSGS = [{"role": "user", "content": "Say something about the sea."}]


@pytest.fixture(scope="module")
def dp():
    with real_engine(data_parallel_size=2, num_threads=1) as engine, background_server(engine) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300)
        yield engine, srv, client


def metric(text: str, name: str, engine: str | None = None) -> float:
    label = f'engine="{engine}"' if engine is not None else ""
    pattern = rf"^{re.escape(name)}\{{[^}}]*{label}[^}}]*\}} ([0-9.e+-]+)$"
    return sum(float(m) for m in re.findall(pattern, text, re.MULTILINE))


def wait_until(predicate, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError("condition not met in time")


def test_requests_spread_over_both_engines_with_one_engines_results(dp):
    engine, srv, client = dp
    assert len(engine.client.engines) == 2

    def one(i: int) -> str:
        prompt = [{"role": "user", "content": f"Topic {i % 8}: say something about the sea."}]
        if i % 2:
            chunks = client.chat.completions.create(model=engine.model_name, messages=prompt, max_tokens=8,
                                                    temperature=0, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        r = client.chat.completions.create(model=engine.model_name, messages=prompt, max_tokens=8, temperature=0)
        return r.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(one, range(32)))
    for i in range(8):  # the same prompt gives the same greedy text, whichever engine ran it
        assert len({texts[j] for j in range(i, 32, 8)}) == 1, [texts[j] for j in range(i, 32, 8)]
    body = httpx.get(srv.url + "/metrics").text
    routed = [metric(body, "tokenspout:engine_requests_routed", str(k)) for k in (0, 1)]
    assert all(r > 0 for r in routed) and sum(routed) >= 32
    assert metric(body, "tokenspout:engine_up", "0") == 1 and metric(body, "tokenspout:engine_up", "1") == 1
    n3 = client.chat.completions.create(model=engine.model_name, messages=MSGS, max_tokens=6, n=3, seed=1)
    assert len(n3.choices) == 3


def test_disconnects_abort_in_the_owning_engine(dp):
    engine, srv, _ = dp

    def start_and_leave(i: int) -> None:
        with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=120, json={
                "model": engine.model_name, "messages": [{"role": "user", "content": f"Essay {i}"}],
                "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    break  # leave mid-stream

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(start_and_leave, range(6)))
    wait_until(lambda: all(s.get("num_running", 1) == 0 and s.get("num_waiting", 1) == 0
                           for s in engine.get_engine_snapshots()) and not engine.client.owner)


def test_one_engine_dies_its_requests_fail_the_other_keeps_serving(dp):
    engine, srv, client = dp
    outcomes: dict[int, str] = {}

    def long_one(i: int) -> None:
        try:
            chunks = client.chat.completions.create(
                model=engine.model_name, messages=[{"role": "user", "content": f"Long story {i}"}],
                max_tokens=120, stream=True, extra_body={"ignore_eos": True})
            n = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
            outcomes[i] = "ok" if n > 0 else "empty"
        except Exception as e:  # noqa: BLE001 - an error frame or status is the expected end for the dead engine's
            outcomes[i] = f"error: {e}"

    victim = engine.client.engines[1].proc
    routed_before = list(engine.client.router.routed)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(long_one, i) for i in range(8)]
        wait_until(lambda: sum(1 for k in engine.client.owner.values() if k == 1) >= 2, timeout=120)
        os.kill(victim.pid, signal.SIGKILL)
        for f in futures:
            f.result(timeout=300)
    routed = [a - b for a, b in zip(engine.client.router.routed, routed_before, strict=True)]
    errors = [v for v in outcomes.values() if v.startswith("error")]
    # Only engine 1's requests fail (those it held, and any routed to it before its death was seen), each naming it.
    assert 1 <= len(errors) <= routed[1] and all("engine 1 of 2 died" in e for e in errors), outcomes
    assert sum(v == "ok" for v in outcomes.values()) >= 8 - routed[1], outcomes
    assert any(v == "ok" for v in outcomes.values()), outcomes  # engine 0's requests finished
    r = client.chat.completions.create(model=engine.model_name, messages=MSGS, max_tokens=4, temperature=0)
    assert r.choices[0].message.content  # the live engine serves, also while engine 1 restarts
    # Engine 1 is restarted alone (the supervisor): /health is 200 again, both engines up, one restart counted.
    wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200, timeout=60)
    assert engine.client.engines[1].proc.pid != victim.pid
    body = httpx.get(srv.url + "/metrics").text
    assert metric(body, "tokenspout:engine_up", "1") == 1 and metric(body, "tokenspout:engine_up", "0") == 1
    assert metric(body, "tokenspout:engine_restarts_total") == 1
