"""Auth, CORS, X-Request-Id, /tokenize, /detokenize and /version on a real server (uvicorn in a thread, the real
AsyncLLM on the default model), through the official `openai` client where it can say the request, httpx elsewhere.
Oracles: the openai client's own error classes, transformers' tokenizer of the same model."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest

from tests.helpers import background_server, real_engine

KEY, OTHER_KEY = "sk-test-key-1", "sk-test-key-2"
ORIGIN = "https://ui.example"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def engine():
    with real_engine() as real:
        yield real


@pytest.fixture(scope="module")
def server(engine):
    with background_server(engine, api_key=[KEY, OTHER_KEY], allowed_origins=[ORIGIN]) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def chat(c: openai.OpenAI, model: str, **kw):
    return c.chat.completions.create(model=model, messages=CHAT, max_tokens=2, temperature=0, **kw)


def test_a_key_is_required_on_v1(server, engine):
    with pytest.raises(openai.AuthenticationError) as exc:
        chat(client(server, "sk-wrong"), engine.model_name)
    assert exc.value.status_code == 401
    err = exc.value.body  # the openai client hands back the "error" object
    assert err["type"] == "AuthenticationError" and err["code"] == 401 and err["param"] is None
    with pytest.raises(openai.AuthenticationError):
        client(server, "sk-wrong").models.list()
    with httpx.Client(base_url=server.url, timeout=60) as anon:  # the openai client will not send without a key
        r = anon.post("/v1/chat/completions", json={"messages": CHAT})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["message"].startswith("Missing API key")
        r = anon.get("/v1/models", headers={"Authorization": f"Basic {KEY}"})
        assert r.status_code == 401
    for key in (KEY, OTHER_KEY):  # any one of the configured keys
        assert chat(client(server, key), engine.model_name).choices[0].message.content


def test_streaming_works_behind_the_middleware(server, engine):
    stream = chat(client(server, KEY), engine.model_name, stream=True)
    assert sum(1 for _ in stream) >= 2


def test_probes_are_open_and_tokenizer_routes_are_not(server):
    with httpx.Client(base_url=server.url, timeout=60) as anon:
        assert anon.get("/health").status_code == 200
        assert anon.get("/metrics").status_code == 200
        assert anon.get("/version").status_code == 200
        for path in ("/tokenize", "/detokenize"):
            r = anon.post(path, json={"prompt": "hi", "tokens": [1]})
            assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"


def test_cors_preflight_is_answered_without_a_key(server):
    with httpx.Client(base_url=server.url, timeout=60) as anon:
        r = anon.options("/v1/chat/completions", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        # A 401 still carries the CORS header, so a browser page can read why it failed.
        r = anon.get("/v1/models", headers={"Origin": ORIGIN})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN
        r = anon.options("/v1/chat/completions", headers={"Origin": "https://evil.example",
                                                          "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in r.headers


def test_x_request_id_is_echoed_and_names_the_response(server, engine):
    c = client(server, KEY)
    raw = c.chat.completions.with_raw_response.create(model=engine.model_name, messages=CHAT, max_tokens=2,
                                                      extra_headers={"X-Request-Id": "trace-42"})
    assert raw.headers["x-request-id"] == "trace-42"
    assert raw.parse().id == "chatcmpl-trace-42"
    raw = c.completions.with_raw_response.create(model=engine.model_name, prompt="Hi", max_tokens=2)
    generated = raw.headers["x-request-id"]
    assert len(generated) == 32 and raw.parse().id == f"cmpl-{generated}"  # one id to grep for in logs
    with httpx.Client(base_url=server.url, timeout=60) as anon:
        assert anon.get("/health", headers={"X-Request-Id": "probe"}).headers["x-request-id"] == "probe"
        assert anon.get("/v1/models", headers={"X-Request-Id": "denied"}).headers["x-request-id"] == "denied"


def test_concurrent_requests_with_the_same_request_id_do_not_collide(server, engine):
    c = client(server, KEY)

    def one(_: int):
        return c.chat.completions.create(model=engine.model_name, messages=CHAT, max_tokens=8, temperature=0,
                                         extra_headers={"X-Request-Id": "same"})

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(one, range(4)))
    assert {o.id for o in outs} == {"chatcmpl-same"}
    assert len({o.choices[0].message.content for o in outs}) == 1  # greedy: all four ran to the same text


def test_tokenize_text_matches_transformers(http, tokenizer, engine):
    text = "The quick brown fox"
    r = http.post("/tokenize", json={"prompt": text, "model": engine.model_name, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == engine.max_model_len
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    assert http.post("/tokenize", json={"prompt": text}).json()["token_strs"] is None


def test_tokenize_chat_counts_the_chat_completions_prompt(server, http, engine, tokenizer):
    usage = chat(client(server, KEY), engine.model_name).usage
    body = http.post("/tokenize", json={"messages": CHAT}).json()
    assert body["count"] == usage.prompt_tokens
    expected = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert body["tokens"] == tokenizer.encode(expected, add_special_tokens=False)
    no_gen = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert no_gen["count"] < body["count"]


def test_detokenize_round_trip_and_errors(http, engine):
    text = "Round trip, with ünïcode and 🙂."
    ids = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": text}
    for body, status, param in (({"tokens": [1, engine.vocab_size]}, 400, "tokens.1"),
                                ({"tokens": [-1]}, 400, "tokens.0"),
                                ({"tokens": "12"}, 400, "tokens"),
                                ({"tokens": [1], "model": "no-such-model"}, 404, "model")):
        r = http.post("/detokenize", json=body)
        assert r.status_code == status, r.text
        assert r.json()["error"]["param"] == param
    r = http.post("/tokenize", json={"prompt": ["not", "text"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_version(server):
    import importlib.metadata

    with httpx.Client(base_url=server.url, timeout=60) as anon:
        assert anon.get("/version").json() == {"version": importlib.metadata.version("tokenspout")}


def test_new_routes_are_in_the_openapi_document(server):
    with httpx.Client(base_url=server.url, timeout=60) as anon:
        spec = anon.get("/openapi.json").json()
    assert {"/tokenize", "/detokenize", "/version"} <= set(spec["paths"])
    assert {"TokenizeCompletionRequest", "TokenizeChatRequest", "DetokenizeRequest"} <= set(
        spec["components"]["schemas"])


def test_tokenizer_info(http, server, tokenizer):
    """vLLM's GET /tokenizer_info: the tokenizer's class and settings, its added tokens, the chat template; no
    local paths; behind the API key as the other tokenizer routes."""
    with httpx.Client(base_url=server.url, timeout=60) as anon:
        assert anon.get("/tokenizer_info").status_code == 401
    info = http.get("/tokenizer_info").json()
    assert info["tokenizer_class"] and info["chat_template"] == tokenizer.chat_template
    assert info["eos_token"] == tokenizer.eos_token and isinstance(info["model_max_length"], int)
    added = info["added_tokens_decoder"]
    assert added and all(set(t) >= {"content", "special"} for t in added.values())
    for token_id, t in added.items():
        assert tokenizer.convert_ids_to_tokens(int(token_id)) == t["content"]
    assert not {"name_or_path", "vocab_file", "tokenizer_file"} & set(info)
