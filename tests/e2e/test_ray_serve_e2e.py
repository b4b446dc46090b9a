"""Replicas on Ray Serve (tokenspout/entrypoints/ray_serve.py): a local Ray cluster of 2 CPUs started by the test,
two replicas of 1 CPU / 1 engine thread each, everything through Ray Serve's HTTP proxy with the official openai
client (AsyncOpenAI): 64 requests, streamed and not, all succeed with one greedy text per prompt; bad input is an
OpenAI-shaped 400; one prompt sticks to one replica; killing one replica's actor mid-load fails only its in-flight
requests (with an error, in bounded time), the other replica's succeed, Ray Serve starts a new replica and later
requests succeed on both.  The cluster is torn down even when a test fails."""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import tempfile
import time

import httpx
import openai
import pytest

ray = pytest.importorskip("ray", reason="requirements-ray.txt is not installed (make test installs it)")
from ray import serve

pytestmark = pytest.mark.slow
APP = "tokenspout"
REPLICA = "TokenspoutReplica"
TIMEOUT = 120.0  # per request: a request on a killed replica must end with an error well before this


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _proxy_serves(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def running_replicas() -> list[str]:
    """Ids of the replica deployment's RUNNING replicas, from the live named actors (no dashboard needed)."""
    prefix = f"SERVE_REPLICA::{APP}#{REPLICA}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    status = serve.status().applications.get(APP)
    if status is None or status.status != "RUNNING":
        return []
    return sorted(n.removeprefix(prefix) for n in names)


@pytest.fixture(scope="module")
def cluster():
    from tokenspout.entrypoints.ray_serve import app

    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    port = free_port()
    try:
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp, logging_level=logging.WARNING,
                 configure_logging=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # Small engines: 1 thread (the default), a 1024-token context, 0.25 GiB of KV cache each.
        serve.run(app({"num_replicas": "2", "max_model_len": "1024", "kv_cache_memory": "0.25"}), name=APP,
                  route_prefix="/")
        # Generous, explicit waits: on cores shared with another CPU-bound process the replicas' model loads and
        # Serve's HTTP proxy take several times longer than on idle ones.
        wait_until(lambda: len(running_replicas()) == 2, 300, "two running replicas")
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _proxy_serves(url), 300, "Serve's HTTP proxy to route /health")
        yield url
    finally:
        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
            shutil.rmtree(temp, ignore_errors=True)


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)


async def chat(c: openai.AsyncOpenAI, content: str, *, stream: bool, max_tokens: int = 8,
               **extra) -> tuple[str, str]:
    """(text, replica id) of one chat completion, streamed or not."""
    kw = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": content}],
          "max_tokens": max_tokens, "temperature": 0, "extra_body": extra or None}
    if not stream:
        raw = await c.chat.completions.with_raw_response.create(**kw)
        return raw.parse().choices[0].message.content or "", raw.headers["x-tokenspout-replica"]
    chunks = await c.chat.completions.create(stream=True, **kw)  # an AsyncStream: its .response has the headers
    text = "".join([ch.choices[0].delta.content or "" async for ch in chunks if ch.choices])
    return text, chunks.response.headers["x-tokenspout-replica"]


def test_64_requests_through_the_proxy_streamed_and_not(cluster):
    async def main() -> list[tuple[str, str]]:
        c = client(cluster)
        jobs = [chat(c, f"Topic {i % 8}: say something about the sea.", stream=bool(i % 2)) for i in range(64)]
        return await asyncio.wait_for(asyncio.gather(*jobs), TIMEOUT)

    results = asyncio.run(main())
    assert all(text for text, _ in results)
    for i in range(8):  # one greedy text per prompt, whichever replica ran it, streamed or not
        assert len({results[j][0] for j in range(i, 64, 8)}) == 1, [results[j] for j in range(i, 64, 8)]
    assert len({replica for _, replica in results}) == 2  # both replicas served


def test_bad_input_is_an_openai_400_and_other_routes_pass(cluster):
    async def main() -> None:
        c = client(cluster)
        with pytest.raises(openai.BadRequestError) as exc:
            await c.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=-1,
                                            messages=[{"role": "user", "content": "x"}])
        assert exc.value.status_code == 400 and exc.value.body["param"] == "temperature"
        models = await c.models.list()
        assert models.data[0].id == "SmolLM2-135M-Instruct"
        done = await c.completions.create(model="SmolLM2-135M-Instruct", prompt="The sea is", max_tokens=4)
        assert done.choices[0].text

    asyncio.run(main())
    assert httpx.post(cluster + "/v1/completions", content=b"{not json",
                      headers={"content-type": "application/json"}).status_code == 400
    assert httpx.get(cluster + "/health").status_code == 200


def test_one_prompt_sticks_to_one_replica(cluster):
    async def main() -> set[str]:
        c = client(cluster)
        return {(await chat(c, "A fixed prompt about lighthouses.", stream=False, max_tokens=2))[1] for _ in range(6)}

    assert len(asyncio.run(main())) == 1  # idle replicas: the affinity holds (README, routing rule)


def test_killed_replica_fails_only_its_requests_and_is_replaced(cluster):
    before = running_replicas()
    assert len(before) == 2
    started: dict[int, str] = {}  # request -> replica, once its first content arrived

    async def long_one(c: openai.AsyncOpenAI, i: int) -> str:
        stream = await c.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": f"Tell a long story, part {i}."}],
            max_tokens=200, stream=True, extra_body={"ignore_eos": True})
        finish = None
        async for ch in stream:
            if ch.choices and ch.choices[0].delta.content:
                started.setdefault(i, stream.response.headers["x-tokenspout-replica"])
            if ch.choices and ch.choices[0].finish_reason:
                finish = ch.choices[0].finish_reason
        return f"ok {finish}"

    async def guarded(c: openai.AsyncOpenAI, i: int) -> str:
        try:
            return await asyncio.wait_for(long_one(c, i), TIMEOUT)
        except TimeoutError:
            return "hung"
        except Exception as e:  # noqa: BLE001 - the expected end of the killed replica's requests
            return f"error: {type(e).__name__}: {e}"

    async def main() -> tuple[str, dict[int, str], list[str]]:
        c = client(cluster)
        tasks = [asyncio.create_task(guarded(c, i)) for i in range(8)]
        deadline = time.monotonic() + TIMEOUT
        while len(set(started.values())) < 2 or len(started) < 8:  # every request streaming, on both replicas
            assert time.monotonic() < deadline, started
            await asyncio.sleep(0.2)
        victim = min(started.values())
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#{REPLICA}#{victim}", namespace="serve"), no_restart=False)
        return victim, dict(started), await asyncio.gather(*tasks)

    victim, owners, outcomes = asyncio.run(main())
    assert "hung" not in outcomes, outcomes
    for i, outcome in enumerate(outcomes):
        if owners[i] == victim:
            assert outcome.startswith("error"), (i, outcome)  # in flight on the killed replica: an error
        else:
            assert outcome == "ok length", (i, outcome)  # the other replica's requests finish untouched
    # Ray Serve replaces the dead replica; later requests succeed, on both replicas again.
    after = wait_until(lambda: (r := running_replicas()) and len(r) == 2 and victim not in r and r, 120,
                       "a replacement replica")
    assert set(after) != set(before)

    async def later() -> list[tuple[str, str]]:
        c = client(cluster)
        return await asyncio.gather(*[chat(c, f"After the crash {i}", stream=bool(i % 2)) for i in range(16)])

    results = asyncio.run(later())
    assert all(text for text, _ in results)
    assert {replica for _, replica in results} <= set(after)


def test_builder_args_threads_cpus_and_autoscaling():
    from tokenspout.entrypoints.cli import build_parser
    from tokenspout.entrypoints.cli_args import parse_cli
    from tokenspout.entrypoints.ray_serve import _argv, build_application, scaling_options

    def parse(*argv: str):
        return parse_cli(*build_parser(), ["serve", "--ray", *argv])

    args = parse(*_argv({"num_replicas": "3", "enable_prefix_caching": "false", "max_model_len": "512"}))
    assert args.num_replicas == 3 and args.enable_prefix_caching is False and args.max_model_len == 512
    assert scaling_options(args) == {"num_replicas": 3}
    replica = build_application(args)._bound_deployment.init_args[0]._bound_deployment
    assert replica.ray_actor_options["num_cpus"] == 1 and replica.init_args[1]["num_threads"] == 1  # defaults
    assert replica.num_replicas == 3 and replica.init_args[1]["enable_prefix_caching"] is False
    replica = build_application(parse("--num-threads", "2"))._bound_deployment.init_args[0]._bound_deployment
    assert replica.ray_actor_options["num_cpus"] == 2 and replica.init_args[1]["num_threads"] == 2
    auto = parse("--min-replicas", "1", "--max-replicas", "4", "--target-ongoing-requests", "8")
    assert scaling_options(auto)["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4,
                                                           "initial_replicas": 1, "target_ongoing_requests": 8}
    with pytest.raises(ValueError, match="min-replicas"):
        scaling_options(parse("--min-replicas", "3", "--max-replicas", "2"))
    with pytest.raises(ValueError, match="num-replicas"):
        build_application(parse("--data-parallel-size", "2"))
