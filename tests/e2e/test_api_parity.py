"""Issue #19, a drop-in for vLLM's OpenAI server: bad input is a 400 (never a 500) naming the field, and vLLM's
request extras (truncate_prompt_tokens, return_token_ids, return_tokens_as_token_ids, continuous_usage_stats,
request_id, chat_template, generation_config defaults) and usage.prompt_tokens_details.cached_tokens work.

One real server (the default model, float32, a short context so that "past the context" is cheap to reach), the
official `openai` client wherever it can express the request, raw httpx where it cannot (bytes it would not send).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import json

import httpx
import openai
import pytest

from tests.helpers import background_server, real_engine
from tests.unit.fake_engine import FakeEngine
from tokenspout.entrypoints.openai.api_server import BackgroundServer, build_app

MAX_MODEL_LEN = 256
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def engine():
    with real_engine(max_model_len=MAX_MODEL_LEN, kv_cache_memory=0.1) as real:
        yield real


@pytest.fixture(scope="module")
def server(engine):
    with background_server(engine, trust_request_chat_template=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(engine) -> str:
    return engine.model_name


def post(server, path: str, body: bytes | dict, content_type: str | None = "application/json") -> httpx.Response:
    headers = {} if content_type is None else {"content-type": content_type}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers=headers, timeout=60)


def bad_request(fn) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        fn()
    body = e.value.body
    assert e.value.status_code == 400 and set(body) == {"message", "type", "param", "code"}, body
    return body


# ---------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("seed", [1 << 64, (1 << 63), -(1 << 63) - 1, 18446744073709551616 * 7])
def test_seed_outside_vllms_range_is_400(client, model, seed):
    body = bad_request(lambda: client.completions.create(model=model, prompt="Hi", max_tokens=1, seed=seed))
    assert body["param"] == "seed"


@pytest.mark.parametrize("seed", [(1 << 63) - 1, -(1 << 63), 0])
def test_seed_at_the_edges_of_vllms_range_is_served(client, model, seed):
    r = client.completions.create(model=model, prompt="Hi", max_tokens=2, seed=seed, temperature=1.0)
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize(("extra", "param"), [
    ({"structured_outputs": {"regex": {"1": "x"}}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": "ab"}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": 5}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"lark": "x"}}, "structured_outputs.lark"),
    ({"structured_outputs": ["regex"]}, "structured_outputs"),
    ({"guided_regex": ["a"]}, "guided_regex"),
    ({"guided_choice": [1, 2]}, "guided_choice.0"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "notjson"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
])
def test_every_structured_output_field_is_type_checked(client, model, extra, param):
    body = bad_request(lambda: client.chat.completions.create(model=model, messages=CHAT, max_tokens=2,
                                                              extra_body=extra))
    assert body["param"] == param, body


@pytest.mark.parametrize("path, field", [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")])
def test_lone_surrogate_is_400(server, path, field):
    # Valid JSON (json.dumps escapes the surrogate as \ud800), but not valid Unicode text.
    text = "ab\ud800c"
    body = {"prompt": text, "max_tokens": 1} if field == "prompt" else \
        {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    r = post(server, path, json.dumps(body).encode())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith(field) and "surrogate" in err["message"]
    r = post(server, path, json.dumps({**body, "stop": ["\udfff"]}).encode() if field == "prompt" else b"{}")
    assert r.status_code == 400


def test_stream_options_need_stream(client, model):
    body = bad_request(lambda: client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=2, stream=False, stream_options={"include_usage": True}))
    assert body["param"] == "stream_options"
    body = bad_request(lambda: client.completions.create(
        model=model, prompt="Hi", max_tokens=2, stream_options={"include_usage": True}))
    assert body["param"] == "stream_options"


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_non_json_content_type_is_415(server, content_type):
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}, content_type)
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == 415 and "application/json" in r.json()["error"]["message"]
    ok = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}, "application/json; charset=utf-8")
    assert ok.status_code == 200


def test_malformed_and_non_object_bodies_are_400(server):
    for raw in (b"{", b"[1, 2]", b"", b'"text"', b"null"):
        r = post(server, "/v1/chat/completions", raw)
        assert r.status_code == 400, (raw, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_max_tokens_past_the_context_is_400(client, model, engine):
    prompt_len = len(engine.processor.tokenize("Hello there"))
    room = MAX_MODEL_LEN - prompt_len
    body = bad_request(lambda: client.completions.create(model=model, prompt="Hello there", max_tokens=room + 1))
    assert body["param"] == "max_tokens"
    assert str(prompt_len) in body["message"] and str(MAX_MODEL_LEN) in body["message"]
    body = bad_request(lambda: client.chat.completions.create(model=model, messages=CHAT,
                                                              max_completion_tokens=MAX_MODEL_LEN))
    assert body["param"] == "max_tokens" and "max_completion_tokens" in body["message"]
    body = bad_request(lambda: client.completions.create(model=model, prompt="Hello there", max_tokens=4,
                                                         extra_body={"min_tokens": room + 1}))
    assert body["param"] == "min_tokens"
    # Exactly the room left is fine.
    r = client.completions.create(model=model, prompt="Hello there", max_tokens=room, extra_body={"min_tokens": 0},
                                  stop=["."], logit_bias={"2": -100})
    assert r.usage.prompt_tokens == prompt_len


def test_completions_default_max_tokens_is_clamped_not_rejected(client, model, engine):
    """OpenAI's legacy default of 16 is not the client's choice: near the end of the context it is cut."""
    ids = [1] + [28] * (MAX_MODEL_LEN - 6)  # 5 tokens of room
    r = client.completions.create(model=model, prompt=ids, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_n_is_bounded(client, model):
    body = bad_request(lambda: client.completions.create(model=model, prompt="Hi", max_tokens=1, n=129))
    assert body["param"] == "n"
    body = bad_request(lambda: client.completions.create(model=model, prompt="Hi", max_tokens=1, n=100000))
    assert body["param"] == "n"


@pytest.mark.parametrize("field", ["functions", "function_call", "logits_processors", "priority", "best_of_x"])
def test_unsupported_fields_are_named(client, model, field):
    body = bad_request(lambda: client.chat.completions.create(model=model, messages=CHAT, max_tokens=1,
                                                              extra_body={field: "auto"}))
    assert body["param"] == field and "unsupported" in body["message"]


def test_reasoning_effort_without_a_reasoning_parser_says_why(client, model):
    """reasoning_effort is supported (issue #31), but only with --reasoning-parser: without one a 400 saying so."""
    body = bad_request(lambda: client.chat.completions.create(model=model, messages=CHAT, max_tokens=1,
                                                              reasoning_effort="low"))
    assert body["param"] == "reasoning_effort" and "reasoning parser" in body["message"]
    body = bad_request(lambda: client.chat.completions.create(model=model, messages=CHAT, max_tokens=1,
                                                              extra_body={"reasoning_effort": "auto"}))
    assert body["param"] == "reasoning_effort"


def test_openapi_describes_request_bodies(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    for path, schema in (("/v1/chat/completions", "ChatCompletionRequest"),
                         ("/v1/completions", "CompletionRequest")):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].endswith(schema)
        props = doc["components"]["schemas"][schema]["properties"]
        assert {"seed", "n", "max_tokens", "structured_outputs", "truncate_prompt_tokens"} <= set(props)
        seed = next(alt for alt in props["seed"]["anyOf"] if alt.get("type") == "integer")
        # (the document writes the bounds as floats: 2^63 - 1 is not exact in one, so compare as floats)
        assert props["n"]["maximum"] == 128 and seed["minimum"] == float(-(1 << 63))
        assert seed["maximum"] == float((1 << 63) - 1)


def test_server_is_healthy_after_bad_input(server, engine):
    assert httpx.get(server.url + "/health").status_code == 200
    assert engine.get_num_unfinished_requests() == 0


# ---------------------------------------------------------------------------------------------- vLLM's extras


def test_truncate_prompt_tokens(client, model, engine):
    prompt = "one two three four five six seven eight nine ten eleven twelve"
    full = len(engine.processor.tokenize(prompt))
    r = client.completions.create(model=model, prompt=prompt, max_tokens=1,
                                  extra_body={"truncate_prompt_tokens": 4, "return_token_ids": True})
    ids = engine.processor.tokenize(prompt)
    assert r.usage.prompt_tokens == 4 < full
    assert r.choices[0].model_extra["prompt_token_ids"] == ids[-4:]
    r = client.completions.create(model=model, prompt=prompt, max_tokens=1, echo=True,
                                  extra_body={"truncate_prompt_tokens": 3, "truncation_side": "right",
                                              "return_token_ids": True})
    assert r.choices[0].model_extra["prompt_token_ids"] == ids[:3]
    assert r.choices[0].text.startswith(engine.tokenizer.decode(ids[:3]))
    body = bad_request(lambda: client.completions.create(model=model, prompt=prompt, max_tokens=1,
                                                         extra_body={"truncate_prompt_tokens": -2}))
    assert body["param"] == "truncate_prompt_tokens"


def test_return_token_ids(client, model, engine):
    r = client.completions.create(model=model, prompt="The sky is", max_tokens=4, temperature=0,
                                  extra_body={"return_token_ids": True})
    c = r.choices[0].model_extra
    assert c["prompt_token_ids"] == engine.processor.tokenize("The sky is")
    assert len(c["token_ids"]) == r.usage.completion_tokens
    assert engine.tokenizer.decode(c["token_ids"]) == r.choices[0].text

    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert len(r.model_extra["prompt_token_ids"]) == r.usage.prompt_tokens
    assert engine.tokenizer.decode(r.choices[0].model_extra["token_ids"]) == r.choices[0].message.content

    # Streams: the prompt's ids once, each chunk its own ids, concatenating to the non-streamed ones.
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, temperature=0,
                                                 stream=True, extra_body={"return_token_ids": True}))
    assert sum(1 for ch in chunks if ch.model_extra.get("prompt_token_ids")) == 1
    streamed = [t for ch in chunks for choice in ch.choices for t in (choice.model_extra.get("token_ids") or [])]
    assert streamed == r.choices[0].model_extra["token_ids"]
    chunks = list(client.completions.create(model=model, prompt="The sky is", max_tokens=4, temperature=0,
                                            stream=True, extra_body={"return_token_ids": True}))
    assert sum(1 for ch in chunks for c in ch.choices if c.model_extra.get("prompt_token_ids")) == 1
    streamed = [t for ch in chunks for c in ch.choices for t in (c.model_extra.get("token_ids") or [])]
    assert len(streamed) == 4


def test_return_tokens_as_token_ids(client, model):
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"return_tokens_as_token_ids": True,
                                                                   "return_token_ids": True})
    ids = r.choices[0].model_extra["token_ids"]
    assert [lp.token for lp in r.choices[0].logprobs.content] == [f"token_id:{t}" for t in ids]
    assert all(t.token.startswith("token_id:") for lp in r.choices[0].logprobs.content for t in lp.top_logprobs)
    r = client.completions.create(model=model, prompt="Hi", max_tokens=3, temperature=0, logprobs=1,
                                  extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    lp = r.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in r.choices[0].model_extra["token_ids"]]
    assert lp.text_offset[0] == 0 and lp.text_offset[-1] < len(r.choices[0].text) + 1


def test_cached_tokens_count_prefix_cache_hits(client, model):
    from tokenspout.config import CacheConfig

    bs = CacheConfig().block_size  # the server's default block: the prefix cache's unit
    prompt = " ".join(f"word{i}" for i in range(40))  # well over two blocks
    first = client.completions.create(model=model, prompt=prompt, max_tokens=1)
    second = client.completions.create(model=model, prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert bs <= cached < second.usage.prompt_tokens and cached % bs == 0


def test_continuous_usage_stats(client, model):
    chunks = list(client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == 5 and chunks[-1].usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=4, stream=True, temperature=0,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks)
    # Without include_usage it counts for nothing (vLLM's rule), and no usage is sent.
    chunks = list(client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=2, stream=True, stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in chunks)


def test_request_chat_template_is_refused_unless_trusted(engine, model):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with background_server(engine) as srv:  # the default: --trust-request-chat-template not given
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        for extra in ({"chat_template": template}, {"chat_template_kwargs": {"chat_template": template}}):
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(model=model, messages=CHAT, max_tokens=1, extra_body=extra)
            assert e.value.body["param"] == "chat_template" and "--trust-request-chat-template" in str(e.value)
        r = httpx.post(srv.url + "/tokenize", json={"messages": CHAT, "chat_template_kwargs": {
            "chat_template": template}})
        assert r.status_code == 400 and "--trust-request-chat-template" in r.json()["error"]["message"]
        assert c.chat.completions.create(model=model, messages=CHAT, max_tokens=1).choices


def test_trusted_request_template_runs_under_a_time_limit(client, model, server):
    """Two nested sandbox-sized loops: 10^10 iterations, stopped at the limit while /health keeps answering."""
    from tokenspout.entrypoints.openai.chat_render import REQUEST_TEMPLATE_TIME_LIMIT_S

    looping = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
    worst: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            t = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200
            worst.append(time.monotonic() - t)
            time.sleep(0.05)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=CHAT, max_tokens=1,
                                           extra_body={"chat_template": looping})
    finally:
        done.set()
        prober.join(10)
    elapsed = time.monotonic() - t0
    assert "ran longer than" in str(e.value) and e.value.body["param"] == "chat_template"
    assert elapsed < REQUEST_TEMPLATE_TIME_LIMIT_S + 3, elapsed
    assert len(worst) >= 10 and max(worst) < 1.0, worst
    # The worker is free again: the next request renders at once.
    assert client.chat.completions.create(model=model, messages=CHAT, max_tokens=1).choices


def test_request_id_field(client, model):
    def one(_: int) -> str:
        r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=3,
                                           extra_body={"request_id": "my-id-1"})
        return r.id

    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # the same id at once must not collide
        ids = list(pool.map(one, range(3)))
    assert ids == ["chatcmpl-my-id-1"] * 3
    r = client.completions.create(model=model, prompt="Hi", max_tokens=1, extra_body={"request_id": "abc"})
    assert r.id == "cmpl-abc"


def test_request_chat_template(client, model, engine):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=1,
                                       extra_body={"chat_template": template, "return_token_ids": True})
    prompt = engine.tokenizer.decode(r.model_extra["prompt_token_ids"])
    assert prompt == "[user] Name a colour.\n[assistant]"


# ---------------------------------------------------------------------------------------------- generation config


class _RecordingEngine(FakeEngine):
    """The fake engine, with a model folder whose generation_config sets sampling defaults."""

    default_sampling_params = {"temperature": 0.25, "top_k": 7, "repetition_penalty": 1.1}

    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def generate(self, prompt, sampling_params, request_id):
        self.seen.append(sampling_params)
        return super().generate(prompt, sampling_params, request_id)


def test_generation_config_defaults_apply_to_omitted_fields():
    eng = _RecordingEngine()
    srv = BackgroundServer(build_app(eng)).start()
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        c.completions.create(model=eng.model_name, prompt="Hi", max_tokens=2)
        c.chat.completions.create(model=eng.model_name, messages=CHAT, max_tokens=2, temperature=0.9,
                                  extra_body={"top_k": 3})
    finally:
        srv.stop()
    first, second = eng.seen
    assert (first.temperature, first.top_k, first.repetition_penalty, first.top_p) == (0.25, 7, 1.1, 1.0)
    assert (second.temperature, second.top_k, second.repetition_penalty) == (0.9, 3, 1.1)


def test_generation_config_modes(tmp_path):
    from tokenspout.config import ModelConfig
    from tokenspout.engine.processor import read_generation_config, sampling_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True, "eos_token_id": [1, 2],
         "min_p": "bad", "repetition_penalty": True}))
    assert sampling_defaults(read_generation_config(tmp_path)) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    with pytest.raises(ValueError, match="generation_config"):
        ModelConfig(generation_config="hf").validate()
