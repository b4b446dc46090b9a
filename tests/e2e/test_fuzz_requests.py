"""Property-based: generated request bodies never get a 5xx and never leave the server unhealthy or a request behind.

Two generators over the generating endpoints (chat, completions, responses, Anthropic messages), against the real engine (its Processor, tokenizer and grammar compiler are
where a 500 would hide):
- bodies shaped by the server's own /openapi.json request schemas (each property drawn by its schema's types,
  enums and bounds, `from_schema` below; hypothesis-jsonschema 0.23 does not run with this hypothesis), with the
  costly knobs (n, max_tokens, min_tokens) cut to a few tokens so that a run stays short; the bounds themselves
  are tested one by one in test_api_parity.py;
- bodies whose known fields hold arbitrary JSON values (wrong types, nesting, huge numbers, odd strings).
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenspout.entrypoints.openai.api_server import BackgroundServer, build_app

pytestmark = pytest.mark.slow

# Every POST route (issue #29: 0 5xx under property-based fuzzing of each).
_PATHS = {"/v1/chat/completions": "ChatCompletionRequest", "/v1/completions": "CompletionRequest",
          "/v1/responses": "ResponsesRequest", "/v1/messages": "MessagesRequest",
          "/v1/messages/count_tokens": "CountTokensRequest", "/tokenize": "TokenizeChatRequest",
          "/detokenize": "DetokenizeRequest", "/invocations": "ChatCompletionRequest"}
_COSTLY = {"n": 2, "max_tokens": 4, "max_completion_tokens": 4, "min_tokens": 2, "best_of": 2,
           "max_output_tokens": 4}


@pytest.fixture(scope="module")
def server():
    from tokenspout.engine.async_llm import AsyncLLM
    from tokenspout.engine.llm import build_engine_config

    engine = AsyncLLM(build_engine_config(None, max_model_len=128, kv_cache_memory=0.05))
    srv = BackgroundServer(build_app(engine)).start()
    yield srv, engine
    srv.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def schemas(server):
    doc = httpx.get(server[0].url + "/openapi.json").json()
    components = doc["components"]["schemas"]
    return {path: (components[name], components) for path, name in _PATHS.items()}


def from_schema(schema: dict, components: dict, depth: int = 0) -> st.SearchStrategy:
    """Values of one JSON schema as FastAPI writes them (type, anyOf, enum/const, bounds, $ref, items,
    properties); deeper than 3 levels, any small JSON value."""
    if depth > 3:
        return _json_values
    if "$ref" in schema:
        return from_schema(components[schema["$ref"].rsplit("/", 1)[1]], components, depth + 1)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, components, depth) for s in schema["anyOf"]])
    if "enum" in schema or "const" in schema:
        return st.sampled_from(schema.get("enum") or [schema["const"]])
    kind = schema.get("type")
    if kind == "integer":
        lo, hi = schema.get("minimum"), schema.get("maximum")
        return st.integers(None if lo is None else int(lo) - 1, None if hi is None else int(hi) + 1)
    if kind == "number":
        return st.floats(allow_nan=False, allow_infinity=False) | st.floats(-3, 3)
    if kind == "string":
        return st.text(max_size=20)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), components, depth + 1), max_size=3)
    if kind == "object" and "properties" in schema:
        props = schema["properties"]
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: from_schema(v, components, depth + 1) for k, v in props.items() if k in required},
            optional={k: from_schema(v, components, depth + 1) for k, v in props.items() if k not in required})
    if kind == "object":
        return st.dictionaries(st.text(max_size=6), _json_values, max_size=3)
    return _json_values


def _cheap(body: dict) -> dict:
    for key, cap in _COSTLY.items():
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and cap < value <= 10_000:
            body[key] = cap
    if body.get("use_beam_search"):
        body["n"] = min(body.get("n") or 1, 2) if isinstance(body.get("n"), int) else body.get("n")
    return body


def _send(srv, path: str, body: dict) -> None:
    try:
        r = httpx.post(srv.url + path, content=json.dumps(body).encode(),
                       headers={"content-type": "application/json"}, timeout=60)
    except httpx.TimeoutException:
        return  # a slow but valid request; the client giving up is an abort the server must absorb
    assert r.status_code < 500, (path, body, r.status_code, r.text[:500])
    if r.status_code >= 400 and path.startswith("/v1/messages"):  # Anthropic's shape
        assert r.json()["type"] == "error" and set(r.json()["error"]) == {"type", "message"}
    elif r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == r.status_code


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
_FIELDS = ["model", "n", "temperature", "top_p", "max_tokens", "stop", "seed", "logit_bias", "stream",
           "stream_options", "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids",
           "allowed_token_ids", "bad_words", "response_format", "guided_json", "guided_regex", "guided_choice",
           "structured_outputs", "truncate_prompt_tokens", "logprobs", "top_logprobs", "echo", "prompt_logprobs",
           "guidance_scale", "return_token_ids", "chat_template_kwargs", "request_id"]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_schema_valid_bodies_never_5xx(server, schemas, data):
    srv, _ = server
    path = data.draw(st.sampled_from(sorted(_PATHS)))
    schema, components = schemas[path]
    body = data.draw(from_schema(schema, components))
    _send(srv, path, _cheap(body))


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(sorted(_PATHS)), fields=st.dictionaries(st.sampled_from(_FIELDS), _json_values,
                                                                     max_size=4))
def test_arbitrary_field_values_never_5xx(server, path, fields):
    srv, _ = server
    base = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    _send(srv, path, _cheap({**base, "max_tokens": 2, **fields}))


def test_server_stays_healthy_and_holds_nothing(server):
    srv, engine = server
    assert httpx.get(srv.url + "/health").status_code == 200
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
    assert engine.get_num_unfinished_requests() == 0
