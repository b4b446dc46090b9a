"""Races the user sees: clients that disconnect mid-stream, and an engine process that dies.  Real engine."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai
import pytest

from tokenspout.engine.async_llm import AsyncLLM
from tokenspout.engine.llm import build_engine_config
from tokenspout.entrypoints.openai.api_server import BackgroundServer, build_app


def _start(max_num_seqs: int = 64, async_scheduling: bool = False):
    engine = AsyncLLM(build_engine_config(None, max_model_len=1024, kv_cache_memory=0.25,
                                          max_num_seqs=max_num_seqs, async_scheduling=async_scheduling))
    server = BackgroundServer(build_app(engine)).start()
    return engine, server


def _idle(engine: AsyncLLM) -> bool:
    st = engine.scheduler_stats
    return (engine.get_num_unfinished_requests() == 0 and st.num_running == 0 and st.num_waiting == 0
            and st.num_free_blocks == st.num_total_blocks)


async def _stream_then_disconnect(client: httpx.AsyncClient, url: str, model: str, chunks: int) -> int:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True,
            "temperature": 1.0}
    seen = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen >= chunks:
                    break  # leaving the context closes the connection mid-stream
    return seen


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_fifty_disconnecting_streams_free_everything(async_scheduling):
    """With async scheduling the aborts arrive while a step is in flight (its results for them are dropped)."""
    engine, server = _start(async_scheduling=async_scheduling)
    try:
        rng = random.Random(0)

        async def main() -> None:
            async with httpx.AsyncClient(timeout=60) as client:
                await asyncio.gather(*[_stream_then_disconnect(client, server.url, engine.model_name,
                                                               rng.randint(1, 12)) for _ in range(50)])

        asyncio.run(main())
        t0 = time.monotonic()
        while not _idle(engine) and time.monotonic() - t0 < 5:
            time.sleep(0.02)
        elapsed = time.monotonic() - t0
        assert _idle(engine), f"engine not idle: {engine.scheduler_stats}"
        assert elapsed < 1.0, f"took {elapsed:.2f} s to free everything after the last disconnect"
        # ... and the server keeps serving.
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        r = c.completions.create(model=engine.model_name, prompt="Hello", max_tokens=5)
        assert r.usage.completion_tokens >= 1
    finally:
        server.stop()
        engine.shutdown()


def test_engine_death_fails_requests_and_health():
    engine, server = _start()
    try:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=30)
        assert httpx.get(server.url + "/health").status_code == 200
        stream = c.completions.create(model=engine.model_name, prompt="Once upon a time", max_tokens=1000,
                                      stream=True, extra_body={"ignore_eos": True})
        t0 = time.monotonic()
        with pytest.raises(openai.APIError):
            for i, _ in enumerate(stream):
                if i == 3:
                    engine.client.proc.kill()
        assert time.monotonic() - t0 < 10, "the in-flight request hung after the engine died"
        deadline = time.monotonic() + 5
        while httpx.get(server.url + "/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(server.url + "/health").status_code == 503
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model=engine.model_name, prompt="Hello", max_tokens=5)
        assert e.value.status_code >= 500
    finally:
        server.stop()
        engine.shutdown()
