"""The OpenAI-compatible server end to end: uvicorn on a free port in a background thread, the official `openai`
client (sync and async) and raw httpx for what the client cannot send.

Tests taking the `engine` fixture are engine-agnostic: they hold for the fake engine and for the real AsyncLLM.
Tests that kill the engine or need to watch its generators use their own FakeEngine and server (`FakeServer`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from typing import Self

import httpx
import openai
import pytest

from tests.helpers import background_server, real_engine
from tests.unit.fake_engine import FakeEngine
from tokenspout.entrypoints.openai.api_server import BackgroundServer, build_app

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module", params=["fake", "real"])
def engine(request):
    """The engine under test: the fake (fast, deterministic) and the real AsyncLLM on the default model."""
    if request.param == "fake":
        yield FakeEngine()
        return
    with real_engine() as real:
        yield real


@pytest.fixture(scope="module")
def server(engine):
    with background_server(engine) as srv:
        yield srv


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return server.url + "/v1"


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(engine) -> str:
    return engine.model_name


def chat(client, model, **kw):
    kw.setdefault("messages", CHAT)
    return client.chat.completions.create(model=model, **kw)


def collect_chat_stream(stream) -> dict:
    """Concatenates a chat stream per choice index, checking the chunk protocol on the way."""
    out: dict[int, dict] = {}
    usage = None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk" and chunk.id.startswith("chatcmpl-")
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for ch in chunk.choices:
            st = out.setdefault(ch.index, {"text": "", "role": None, "finish": None, "stop_reason": None, "lp": []})
            assert st["finish"] is None, "nothing may follow a choice's finish chunk"
            if ch.delta.role is not None:
                assert st["role"] is None and st["text"] == "", "the role comes once, first"
                st["role"] = ch.delta.role
            st["text"] += ch.delta.content or ""
            if ch.logprobs is not None and ch.logprobs.content:
                st["lp"].extend(ch.logprobs.content)
            if ch.finish_reason is not None:
                st["finish"] = ch.finish_reason
                st["stop_reason"] = getattr(ch, "stop_reason", None) or (ch.model_extra or {}).get("stop_reason")
    return {"choices": out, "usage": usage}


# ---------------------------------------------------------------------------------------------- basics


def test_models_and_health(client, model, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [model]
    assert httpx.get(server.url + "/health").status_code == 200


def test_chat_non_streaming(client, model):
    r = chat(client, model, max_tokens=8, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == model
    assert abs(r.created - time.time()) < 60
    (choice,) = r.choices
    assert choice.index == 0 and choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_non_streaming(client, model):
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert len(r.choices) == 1 and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_model_may_be_omitted_and_unknown_model_is_404(base_url, client):
    r = httpx.post(base_url + "/chat/completions", json={"messages": CHAT, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
    with pytest.raises(openai.NotFoundError) as e:
        chat(client, "no-such-model", max_tokens=2)
    assert e.value.body["param"] == "model"


def test_content_parts_and_roles(client, model):
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Again?"},
    ]
    r = chat(client, model, messages=messages, max_tokens=3, extra_body={"add_generation_prompt": True})
    assert r.choices[0].message.content is not None


def test_unknown_fields_are_rejected_by_name(client, model):
    """A field the server would silently ignore is a 400 naming it (OpenAI's own API answers so too)."""
    r = chat(client, model, max_tokens=2, user="someone", extra_body={"metadata": {"k": "v"}, "store": False})
    assert r.choices
    for field in ("no_such_field", "logits_processors", "priority"):
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, model, max_tokens=2, extra_body={field: [1, 2]})
        assert e.value.body["param"] == field and "unsupported field" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, max_tokens=2, messages=[{"role": "user", "content": "hi", "audio": {"id": "x"}}])
    assert e.value.body["param"] == "messages.0.audio"


def test_vllm_extras_are_accepted(client, model):
    extras = {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True,
              "stop_token_ids": [2], "include_stop_str_in_output": False, "skip_special_tokens": True,
              "spaces_between_special_tokens": True, "bad_words": ["zebra"]}
    r = chat(client, model, max_tokens=4, temperature=0.7, seed=3, presence_penalty=0.5, frequency_penalty=0.5,
             logit_bias={"100": 1.5}, stop=["\n\n"], extra_body=extras)
    assert r.usage.completion_tokens >= 2
    r = client.completions.create(model=model, prompt="Hi", max_tokens=3, extra_body={"allowed_token_ids": [10, 11, 12]})
    assert r.usage.completion_tokens >= 1


# ---------------------------------------------------------------------------------------------- stream == non-stream


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "top_p": 0.95, "seed": 1234}])
def test_chat_stream_equals_non_stream(client, model, sampling):
    kw = {"max_tokens": 24, "n": 2, **sampling}
    full = chat(client, model, **kw)
    streamed = collect_chat_stream(chat(client, model, stream=True, stream_options={"include_usage": True}, **kw))
    assert sorted(streamed["choices"]) == [0, 1]
    for c in full.choices:
        s = streamed["choices"][c.index]
        assert s["role"] == "assistant"
        assert s["text"] == c.message.content
        assert s["finish"] == c.finish_reason
    assert streamed["usage"].model_dump() == full.usage.model_dump()


def test_completion_stream_equals_non_stream(client, model):
    kw = {"prompt": ["The capital of France", "Two plus two"], "max_tokens": 12, "n": 2, "temperature": 0.9,
          "seed": 99}
    full = client.completions.create(model=model, **kw)
    assert [c.index for c in full.choices] == [0, 1, 2, 3]  # prompt-major x n
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(model=model, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            assert ch.index not in finishes
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert texts == {c.index: c.text for c in full.choices}
    assert finishes == {c.index: c.finish_reason for c in full.choices}
    assert usage.model_dump() == full.usage.model_dump()


def test_no_usage_chunk_without_include_usage(client, model):
    for chunk in chat(client, model, stream=True, max_tokens=3):
        assert chunk.usage is None and chunk.choices


# ---------------------------------------------------------------------------------------------- usage, n, logprobs


def test_usage_is_exact(client, model, engine):
    ids = [1100, 1101, 1102, 1103, 1104]
    r = client.completions.create(model=model, prompt=ids, max_tokens=7, extra_body={"ignore_eos": True}, logprobs=0)
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 7 == len(r.choices[0].logprobs.tokens)
    s = collect_chat_stream(chat(client, model, stream=True, stream_options={"include_usage": True}, max_tokens=9,
                                 logprobs=True, n=2, extra_body={"ignore_eos": True}))
    assert s["usage"].completion_tokens == 18 == sum(len(c["lp"]) for c in s["choices"].values())
    assert all(c["finish"] == "length" for c in s["choices"].values())


def test_n_choices_indices(client, model):
    r = chat(client, model, n=3, max_tokens=4, temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    greedy = chat(client, model, n=2, max_tokens=6, temperature=0)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def test_chat_logprobs_shape(client, model):
    r = chat(client, model, max_tokens=5, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for entry in content:
        assert isinstance(entry.token, str) and entry.logprob <= 0
        if "\ufffd" not in entry.token:
            assert entry.bytes == list(entry.token.encode("utf-8"))
        else:  # part of a character: its own bytes (TokenBytes), not U+FFFD's
            assert entry.bytes and bytes(entry.bytes).find(b"\xef\xbf\xbd") < 0
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and entry.logprob <= tops[0] + 1e-6
    assert chat(client, model, max_tokens=2).choices[0].logprobs is None
    r = chat(client, model, max_tokens=3, logprobs=True)  # no top_logprobs: only the sampled token
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)


def test_completion_logprobs_shape_and_echo(client, model):
    prompt = "Hello world"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=4, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    # top-2, plus the sampled token when outside them (fewer when two ids decode to the same string)
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    e = client.completions.create(model=model, prompt=prompt, max_tokens=4, logprobs=1, echo=True,
                                  extra_body={"ignore_eos": True})
    assert e.choices[0].text.startswith(prompt)
    elp = e.choices[0].logprobs
    n_prompt = e.usage.prompt_tokens
    assert len(elp.tokens) == n_prompt + 4
    assert elp.token_logprobs[0] is None  # the first prompt token; the rest: tests/e2e/test_prompt_logprobs_e2e.py
    assert all(x is not None for x in elp.token_logprobs[n_prompt:])
    s = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=prompt, max_tokens=4, echo=True, stream=True, temperature=0) if c.choices)
    assert s.startswith(prompt)


def test_completion_text_offsets_with_split_characters(client, model, engine):
    """An emoji is four byte-level tokens here: their text_offset is the emoji's (counted on bytes); adding up each
    token's text alone ("\ufffd" each) put ' ok' at 6 of 'Say 😀 ok' and the last offset past the text."""
    if getattr(engine, "tokenizer", None) is None or "Fake" in type(engine.tokenizer).__name__:
        pytest.skip("the fake engine's tokenizer has one character per token")
    for stream in (False, True):
        kw = {"model": model, "prompt": "Say 😀 ok", "max_tokens": 2, "echo": True, "logprobs": 0, "temperature": 0}
        if stream:
            chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True) if c.choices]
            text = "".join(c.text for c in chunks)
            tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
            offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
        else:
            ch = client.completions.create(**kw).choices[0]
            text, tokens, offsets = ch.text, ch.logprobs.tokens, ch.logprobs.text_offset
        ok = tokens.index(" ok")
        assert offsets[ok] == text.index(" ok") and text[offsets[ok]:].startswith(" ok"), (stream, offsets)
        assert offsets == sorted(offsets) and offsets[-1] < len(text)
        # " \xf0\x9f\x98" starts at the space, "\x80" (which completes the emoji) at the emoji
        assert [o for t, o in zip(tokens[:ok], offsets[:ok]) if "\ufffd" in t] == [3, 4], (tokens, offsets)


# ---------------------------------------------------------------------------------------------- stop, max_tokens


def test_stop_strings(client, model):
    base = chat(client, model, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}).choices[0].message
    text = base.content
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), f"degenerate output {text!r}"
    pos = text.find(stop)
    r = chat(client, model, max_tokens=24, temperature=0, stop=stop, extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.message.content == text[:pos]
    assert c.finish_reason == "stop" and (c.model_extra or {}).get("stop_reason") == stop
    inc = chat(client, model, max_tokens=24, temperature=0, stop=[stop],
               extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert inc.choices[0].message.content == text[: pos + len(stop)]
    s = collect_chat_stream(chat(client, model, max_tokens=24, temperature=0, stop=[stop], stream=True,
                                 extra_body={"ignore_eos": True}))
    assert s["choices"][0]["text"] == text[:pos] and s["choices"][0]["finish"] == "stop"


def test_max_tokens_none_runs_to_the_context_end(client, model, engine):
    prompt = [1100] * (engine.max_model_len - 5)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=None, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == engine.max_model_len


# ---------------------------------------------------------------------------------------------- bad input


# Errors found by the engine (ids outside the vocabulary, prompt too long) are 400 whatever the engine; the field
# they name depends on its message, so `param` is checked only against the fake (marked `engine_checked`).
ENGINE_CHECKED = {"logit_bias-vocab", "prompt-ids", "stop_token_ids", "allowed_token_ids"}


def check_param(engine, body: dict, param: str, case: str) -> None:
    if case not in ENGINE_CHECKED or isinstance(engine, FakeEngine):
        assert body["param"] == param, body


@pytest.mark.parametrize(
    ("kwargs", "param", "case"),
    [
        ({"max_tokens": -1}, "max_tokens", ""),
        ({"max_completion_tokens": 0}, "max_completion_tokens", ""),
        ({"temperature": -0.5}, "temperature", ""),
        ({"top_p": 0.0}, "top_p", ""),
        ({"top_p": 1.5}, "top_p", ""),
        ({"n": 0}, "n", ""),
        ({"presence_penalty": 3.0}, "presence_penalty", ""),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", ""),
        ({"top_logprobs": 2}, "top_logprobs", ""),
        ({"logit_bias": {"not-an-id": 1}}, "logit_bias", ""),
        ({"logit_bias": {"10000000": 1}}, "logit_bias", "logit_bias-vocab"),
        ({"messages": []}, "messages", ""),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages.0.content.0", ""),
        ({"extra_body": {"top_k": -5}}, "top_k", ""),
        ({"extra_body": {"min_tokens": 50}, "max_tokens": 10}, "min_tokens", ""),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_chat_bad_input_is_400(client, model, engine, kwargs, param, case, stream):
    kwargs = dict(kwargs)  # parametrize shares the dict between runs
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, stream=stream, max_tokens=kwargs.pop("max_tokens", 4), **kwargs)
    assert e.value.status_code == 400
    assert e.value.body["type"] == "BadRequestError" and e.value.body["message"]
    check_param(engine, e.value.body, param, case)


@pytest.mark.parametrize(
    ("kwargs", "param", "case"),
    [
        ({"logprobs": 21}, "logprobs", ""),
        ({"prompt": []}, "prompt", ""),
        ({"prompt": [-1, 3]}, "prompt", "prompt-ids"),
        ({"prompt": [10_000_000]}, "prompt", "prompt-ids"),
        ({"extra_body": {"stop_token_ids": [10_000_000]}}, "stop_token_ids", "stop_token_ids"),
        ({"extra_body": {"allowed_token_ids": [10_000_000]}}, "allowed_token_ids", "allowed_token_ids"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_completion_bad_input_is_400(client, model, engine, kwargs, param, case, stream):
    kwargs = {"prompt": "hello", **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, max_tokens=3, stream=stream, **kwargs)
    check_param(engine, e.value.body, param, case)


def test_prompt_longer_than_context_is_400(client, model, engine):
    long_text = "hello " * (engine.max_model_len + 10)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError):
            chat(client, model, messages=[{"role": "user", "content": long_text}], max_tokens=2, stream=stream)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=model, prompt=["short", long_text], max_tokens=2, stream=stream)


@pytest.mark.parametrize(
    "body",
    [b"{not json", b"", b"[1, 2]", b'"text"', b'{"messages": "hi"}', b'{"messages": [{"content": "x"}]}',
     b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}',
     b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}',
     b'{"messages": [{"role": "user", "content": "x"}], "stop": 5}',
     b'{"messages": [{"role": "user", "content": "x"}], "n": 1.5}'],
)
def test_malformed_requests_are_400_not_422(base_url, body):
    for path in ("/chat/completions", "/completions"):
        r = httpx.post(base_url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == 400 and err["type"] == "BadRequestError" and err["message"]


def test_server_survives_bad_input(client, model, server):
    for _ in range(3):
        with pytest.raises(openai.BadRequestError):
            chat(client, model, max_tokens=-1)
    assert httpx.get(server.url + "/health").status_code == 200
    assert chat(client, model, max_tokens=2).choices


# ---------------------------------------------------------------------------------------------- async client


async def test_async_client_concurrent(base_url, model):
    aclient = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)

    async def streamed(i: int) -> str:
        stream = await aclient.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=8, stream=True,
            temperature=0.5, seed=i)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def whole(i: int) -> str:
        r = await aclient.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=8, temperature=0.5,
            seed=i)
        return r.choices[0].message.content

    streamed_texts = await asyncio.gather(*(streamed(i) for i in range(6)))
    whole_texts = await asyncio.gather(*(whole(i) for i in range(6)))
    assert streamed_texts == whole_texts
    c = await aclient.completions.create(model=model, prompt=["a", "b", "c"], max_tokens=3, n=2)
    assert [ch.index for ch in c.choices] == list(range(6))
    await aclient.close()


# ---------------------------------------------------------------------------------------------- metrics, bench


def test_metrics_endpoint(client, model, server, engine):
    def value(text: str, name: str) -> float:
        for line in text.splitlines():
            if line.startswith((name + "{", name + " ")):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} not exported")

    before = httpx.get(server.url + "/metrics").text
    r = chat(client, model, max_tokens=5, stream=False)
    list(chat(client, model, max_tokens=5, stream=True))
    after = httpx.get(server.url + "/metrics")
    assert after.status_code == 200 and after.headers["content-type"].startswith("text/plain")
    text = after.text
    gen = value(text, "tokenspout:generation_tokens_total") - value(before, "tokenspout:generation_tokens_total")
    assert gen >= r.usage.completion_tokens
    for name in ("tokenspout:time_to_first_token_seconds_count", "tokenspout:inter_token_latency_seconds_count",
                 "tokenspout:e2e_request_latency_seconds_count", "tokenspout:num_requests_running",
                 "tokenspout:kv_cache_usage_perc", "tokenspout:wasted_tokens_total",
                 "tokenspout:spec_decode_num_accepted_tokens_total", "tokenspout:prompt_tokens_total"):
        value(text, name)
    assert value(text, "tokenspout:time_to_first_token_seconds_count") >= 1
    if isinstance(engine, FakeEngine):
        return  # the fake engine has no KV cache
    # The same chat twice, one after the other: the second finds the first's full prompt blocks cached.
    assert value(text, "tokenspout:prefix_cache_hits_total") > value(before, "tokenspout:prefix_cache_hits_total")
    assert value(text, "tokenspout:prefix_cache_queries_total") > value(text, "tokenspout:prefix_cache_hits_total")


def test_bench_serve_smoke(base_url, model, tmp_path):
    from bench.serve import main

    out = tmp_path / "serve.json"
    report = main(["--base-url", base_url, "--model", model, "--concurrency", "1", "3", "--mode", "greedy",
                   "random", "--max-tokens", "4", "--num-requests", "4", "--label", "test", "--out", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert rows == report["results"] and len(rows) == 4
    for row in rows:
        assert row["errors"] == 0 and row["completed"] == 4 and row["output_tokens"] == 16
        assert row["ttft_p50_ms"] is not None and row["output_tok_s"] > 0
    # --context: a document of about N tokens before each question, a different one per request and per level
    from bench.serve import with_context

    ctx = main(["--base-url", base_url, "--model", model, "--concurrency", "1", "2", "--mode", "greedy",
                "--max-tokens", "2", "--num-requests", "2", "--context", "100"])["results"]
    plain = max(row["prompt_tokens_p50"] for row in rows)
    assert all(row["errors"] == 0 and row["prompt_tokens_p50"] > 2 * plain for row in ctx)
    if model != "fake-model":  # (the fake engine's tokenizer reads characters, not the default model's tokens)
        assert all(80 <= row["prompt_tokens_p50"] <= 170 for row in ctx)
    docs = {with_context("Hi", i, 100).split("With those notes")[0] for i in range(4)}
    assert len(docs) == 4 and with_context("Hi", 0, 0) == "Hi"


def test_bench_serve_reports_failures(base_url, model):
    """The benchmark's client turns a non-200 answer and a refused connection into per-request errors."""
    from bench import serve

    args = serve.parse_args(["--base-url", base_url, "--model", "no-such-model"])
    res = asyncio.run(serve.one_request(serve.Target.from_args(args), serve.request_body(args, "Hi", "greedy", 2)))
    assert not res.ok and res.error.startswith("HTTP 404") and "does not exist" in res.error
    args = serve.parse_args(["--base-url", "http://127.0.0.1:9/v1", "--model", model])
    res = asyncio.run(serve.one_request(serve.Target.from_args(args), serve.request_body(args, "Hi", "greedy", 2)))
    assert not res.ok and res.error.startswith(("ConnectionRefusedError", "OSError"))


# ---------------------------------------------------------------------------------------------- fake-engine only


class FakeServer:
    """A dedicated fake engine + server, for tests that kill the engine or watch its generators."""

    def __init__(self, token_delay: float) -> None:
        self.engine = FakeEngine(token_delay=token_delay)
        self.server = BackgroundServer(build_app(self.engine))

    def __enter__(self) -> Self:
        self.server.start()
        self.base_url = self.server.url + "/v1"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()

    def only_record(self):
        (rec,) = self.engine.records.values()
        return rec


def _wait_for_record(fs: FakeServer, timeout: float = 5.0):
    end = time.monotonic() + timeout
    while not fs.engine.records:
        assert time.monotonic() < end, "the request never reached the engine"
        time.sleep(0.01)
    return fs.only_record()


def test_disconnect_mid_stream_closes_the_engine_generator():
    with FakeServer(token_delay=0.05) as fs:
        body = {"messages": CHAT, "stream": True, "max_tokens": 1000, "ignore_eos": True}
        with httpx.Client(timeout=30) as hc, hc.stream("POST", fs.base_url + "/chat/completions", json=body) as r:
            assert r.status_code == 200
            frames = 0
            for line in r.iter_lines():
                frames += line.startswith("data: ")
                if frames >= 3:
                    break
        t0 = time.monotonic()
        rec = fs.only_record()
        assert rec.closed.wait(3.0), "the engine generator was not closed after the client went away"
        assert rec.outcome == "closed" and time.monotonic() - t0 < 3.0


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_before_first_token_closes_the_engine_generator(stream):
    with FakeServer(token_delay=30.0) as fs:
        body = {"prompt": "hi", "stream": stream, "max_tokens": 5}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(fs.base_url + "/completions", json=body, timeout=httpx.Timeout(30.0, read=0.5))
        rec = _wait_for_record(fs)
        assert rec.closed.wait(3.0), "the engine generator was not closed after the client went away"
        assert rec.outcome == "closed"


def test_engine_death_mid_stream_errors_and_health_503():
    with FakeServer(token_delay=0.02) as fs:
        client = openai.OpenAI(base_url=fs.base_url, api_key="unused", max_retries=0, timeout=30)
        stream = client.chat.completions.create(model="fake-model", messages=CHAT, stream=True, max_tokens=1000,
                                                extra_body={"ignore_eos": True})
        received = 0
        t0 = time.monotonic()
        with pytest.raises(openai.APIError) as e:
            for _ in stream:
                received += 1
                if received == 3:
                    fs.engine.kill()
        assert time.monotonic() - t0 < 5.0
        assert "dead" in str(e.value.message)
        assert httpx.get(fs.server.url + "/health").status_code == 503
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model="fake-model", messages=CHAT, max_tokens=2)
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model="fake-model", prompt="x", max_tokens=2, stream=True)


def test_engine_death_during_non_streaming_request_is_500():
    with FakeServer(token_delay=0.02) as fs:
        client = openai.OpenAI(base_url=fs.base_url, api_key="unused", max_retries=0, timeout=30)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(client.completions.create, model="fake-model", prompt="x", max_tokens=1000,
                              extra_body={"ignore_eos": True})
            _wait_for_record(fs)
            time.sleep(0.1)
            fs.engine.kill()
            with pytest.raises(openai.InternalServerError) as e:
                fut.result(timeout=5)
        assert e.value.status_code == 500 and e.value.body["type"] == "InternalServerError"
        assert fs.only_record().outcome == "dead"
