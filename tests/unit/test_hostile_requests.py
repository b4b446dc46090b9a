"""Hostile and odd request bodies found by an audit of the HTTP API (session 30): each a clear 400 naming the field,
no 500, nothing silently ignored, no request that holds the event loop for seconds while it is validated."""

from __future__ import annotations

import json
import math
import random
import time

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from tests.unit.fake_engine import FakeEngine
from tokenspout.engine.beam_search import BeamSearch
from tokenspout.entrypoints.openai.api_server import build_app
from tokenspout.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIServingError,
    validation_error_to_serving_error,
)
from tokenspout.entrypoints.openai.protocol.sampling import _clean, _locate_fault
from tokenspout.entrypoints.openai.serving_common import to_serving_error
from tokenspout.entrypoints.openai.serving_responses import response_id
from tokenspout.entrypoints.openai.structured import structured_outputs_from_request
from tokenspout.sampling_params import SamplingParams
from tokenspout.structured_output.llguidance_backend import validate as validate_grammar

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client():
    with TestClient(build_app(FakeEngine())) as c:
        yield c


def _param(e: pytest.ExceptionInfo) -> str | None:
    return validation_error_to_serving_error(e.value).param


# ------------------------------------------------------------------------------------------------- beam search


@pytest.mark.parametrize("value", [1000.0, -1000.0, 1e308, math.inf, math.nan])
def test_length_penalty_out_of_range_is_a_400(value):
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": "x", "use_beam_search": True, "n": 2, "length_penalty": value})
    assert _param(e) == "length_penalty"
    with pytest.raises(ValueError, match="length_penalty"):
        BeamSearch([[1]], 2, 4, None, value)  # the offline API's check
    CompletionRequest.model_validate({"prompt": "x", "use_beam_search": True, "n": 2, "length_penalty": -2.5})


@pytest.mark.parametrize("extra", [{"stop": ["-"]}, {"logprobs": 2}, {"prompt_logprobs": 2},
                                   {"guided_choice": ["yes", "no"]}, {"logit_bias": {"5": 3}}, {"top_p": 0.5},
                                   {"seed": 3}, {"ignore_eos": True}, {"max_tokens": 0}, {"temperature": 0.7}])
def test_beam_search_refuses_what_it_would_ignore(extra):
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": "x", "use_beam_search": True, "n": 2, **extra})
    assert _param(e) == next(iter(extra))
    CompletionRequest.model_validate({"prompt": "x", **extra})  # each is fine without beam search


def test_beam_search_takes_what_it_honours():
    r = CompletionRequest.model_validate({"prompt": ["a", "b"], "use_beam_search": True, "n": 3, "best_of": 3,
                                          "max_tokens": 4, "length_penalty": 0.5, "echo": True, "temperature": 0,
                                          "request_id": "r1", "user": "u", "stop": None})
    assert r.use_beam_search and r.n == 3  # an explicit default (stop null) changes nothing: accepted


# ------------------------------------------------------------------------------------------------- sampling fields


def test_logit_bias_nan_is_an_error_and_infinities_clamp():
    with pytest.raises(ValueError, match="NaN for token 12"):
        SamplingParams(logit_bias={12: math.nan}).validate()
    SamplingParams(logit_bias={12: math.inf, 13: -math.inf}).validate()  # clamped to +-100 as any bias


def test_logit_bias_nan_over_http(client):
    r = client.post("/v1/completions", content=b'{"prompt": "x", "max_tokens": 2, "logit_bias": {"12": NaN}}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x", "stop": ["y" * 1025]}),
    (CHAT, {"messages": MSG, "stop": "y" * 100_000}),
    ("/v1/messages", {"messages": MSG, "max_tokens": 4, "stop_sequences": ["y" * 2000]})])
def test_a_stop_string_past_its_bound_is_a_400(client, path, body):
    """(each is followed by an automaton built from it while the text streams: 64 stop strings of 120k characters
    had cost 45 ms of the event loop per streamed chunk)"""
    r = client.post(path, json={"model": "fake-model", **body})
    assert r.status_code == 400 and "at most 1024 characters" in r.text, r.text


@pytest.mark.parametrize("rid", ["evil\n2026-11-27 12:00:00,000 engine ERROR FORGED", "caf\u00e9", "a\u202eb", "x" * 257, ""])
@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/v1/responses"])
def test_body_request_id_follows_the_header_rule(client, path, rid):
    body = {"input": "hi"} if path == "/v1/responses" else {"messages": MSG} if path == CHAT else {"prompt": "hi"}
    r = client.post(path, json={**body, "max_tokens" if path != "/v1/responses" else "max_output_tokens": 2,
                                "request_id": rid})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", r.text
    ok = client.post(path, json={**body, "request_id": "trace-1 (ok)"})
    assert ok.status_code == 200, ok.text


# ------------------------------------------------------------------------------------------------- whole bodies


@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/v1/responses"])
@pytest.mark.parametrize("raw", [b"", b"[]", b"null", b"5", b'"x"'])
def test_a_body_that_is_no_object_names_no_field(client, path, raw):
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] is None, r.text
    assert "request body" in err["message"] and "Field" not in err["message"], err


def test_a_long_prompt_list_is_refused_before_it_is_walked():
    body = {"prompt": [[1]] * 300_000, "max_tokens": 1}
    with pytest.raises(ValidationError) as e:  # a length check before the walk (walking 1.4M lists took ~6 s)
        CompletionRequest.model_validate(body)
    err = validation_error_to_serving_error(e.value)
    assert err.param == "prompt" and "--max-request-fanout" in err.message
    CompletionRequest.model_validate({"prompt": [1] * 300_000})  # a flat list of ids is one prompt


def _random_json(rng: random.Random, depth: int):
    kind = rng.random()
    if depth > 6 or kind < 0.4:
        return rng.choice([1, 2.5, True, None, "ascii", "caf\u00e9", "\ud800", "\udfff x", "\ud83d\ude00"])
    if kind < 0.7:
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["a", "b", "\ud801", "k"]) + str(i): _random_json(rng, depth + 1)
            for i in range(rng.randint(0, 3))}


def test_the_fast_text_walk_agrees_with_the_one_that_names_the_fault():
    from tokenspout.entrypoints.openai.protocol.bounds import bind_bounds
    from tokenspout.entrypoints.openai.protocol.bounds import RequestBounds

    rng = random.Random(0)
    for limit, containers in ((3, 1000), (5, 1000), (64, 1000), (64, 4), (5, 7)):
        bind_bounds(RequestBounds(json_depth=limit, json_containers=containers))
        try:
            for _ in range(3000):
                value = _random_json(rng, 0)
                clean = _clean(value, 0, limit, [containers])
                try:
                    _locate_fault(value, "", 0, [containers])
                    located = None
                except ValueError as e:
                    located = str(e)
                assert clean == (located is None), (value, located)
        finally:
            bind_bounds(RequestBounds())


def test_a_body_of_a_million_containers_is_refused_quickly():
    body = {"messages": [{"role": "user", "content": "hi", "x": [[]] * 1_000_000}]}
    with pytest.raises(ValidationError) as e:  # (the walk stops at the bound: walking all took 1-1.7 s)
        ChatCompletionRequest.model_validate(body)
    err = validation_error_to_serving_error(e.value)
    assert err.param == "messages" and "--max-request-json-containers" in err.message, err.message
    ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi", "x": [[]] * 1000}]})


# ------------------------------------------------------------------------------------------------- /tokenize


def test_tokenize_refuses_a_request_template_and_unknown_fields(client):
    r = client.post("/tokenize", json={"messages": MSG, "chat_template": "{{ 1/0 }}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    r = client.post("/tokenize", json={"prompt": "hi", "bogus_field": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bogus_field", r.text
    r = client.post("/tokenize", json={"prompt": "hi", "messages": MSG})  # which one was meant?
    assert r.status_code == 400, r.text
    r = client.post("/detokenize", json={"tokens": [1000], "extra": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "extra", r.text
    assert client.post("/tokenize", json={"prompt": "hi"}).json()["count"] == 2


# ------------------------------------------------------------------------------------------------- grammars


@pytest.mark.parametrize("body, param", [
    ({"guided_regex": "(a"}, "guided_regex"),
    ({"guided_regex": "a\\"}, "guided_regex"),
    ({"guided_regex": "\\"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
])
def test_invalid_constraints_name_the_field_sent(body, param):
    req = CompletionRequest.model_validate({"prompt": "x", **body})
    with pytest.raises(ValueError) as e:
        validate_grammar(structured_outputs_from_request(req))
    assert to_serving_error(e.value).param == param, str(e.value)
    validate_grammar(structured_outputs_from_request(CompletionRequest.model_validate(
        {"prompt": "x", "guided_regex": "a\\\\"})))  # an escaped backslash is fine


def test_grammar_limit_mid_generation_is_the_requests_error():
    """A counted repetition past llguidance's lexer limit validates (it expands lazily) and breaks on its first
    token: GrammarFailed from the matcher, a ValueError naming the field from the manager (the engine finishes the
    request with it as bad input)."""
    from tokenspout.models.default_model import default_model_path
    from tokenspout.structured_output.manager import StructuredOutputManager
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_path()))
    manager = StructuredOutputManager(tok, len(tok))
    params = structured_outputs_from_request(CompletionRequest.model_validate(
        {"prompt": "x", "guided_regex": "a{1000000}"}))
    manager.submit("r", params)
    # a grammar that only fails to compile against the vocabulary names its field too (the engine's 400)
    manager.submit("g", structured_outputs_from_request(CompletionRequest.model_validate(
        {"prompt": "x", "guided_grammar": "root ::= root"})))
    deadline = time.time() + 60
    while not (manager.is_ready("r") and manager.is_ready("g")) and time.time() < deadline:
        time.sleep(0.01)
    assert manager.error("r") is None
    assert manager.error("g").startswith("guided_grammar is invalid"), manager.error("g")
    with pytest.raises(ValueError, match="^guided_regex is invalid: lexer error: too many expressions constructed "
                                         r"\(the grammar broke one of its limits while generating\)$"):
        manager.accept("r", tok.encode("a"))
    for rid in ("r", "g"):
        manager.remove(rid)
    manager.shutdown()


# ------------------------------------------------------------------------------------------------- /v1/responses


def test_response_ids_are_unique_and_url_safe(client):
    a = client.post("/v1/responses", json={"input": "one", "request_id": "same", "max_output_tokens": 2}).json()
    b = client.post("/v1/responses", json={"input": "two", "request_id": "same", "max_output_tokens": 2}).json()
    assert a["id"] != b["id"] and a["id"].startswith("resp_same")
    assert client.get(f"/v1/responses/{a['id']}").json()["id"] == a["id"]
    assert client.get(f"/v1/responses/{b['id']}").json()["id"] == b["id"]
    c = client.post("/v1/responses", json={"input": "x", "request_id": "a/b?c", "max_output_tokens": 2}).json()
    assert "/" not in c["id"] and "?" not in c["id"]
    assert client.get(f"/v1/responses/{c['id']}").status_code == 200
    assert response_id("chatcmpl-x y/z") == "resp_x_y_z"


def test_json_body_is_parsed_once_with_the_same_semantics(client):
    # duplicate keys (the last wins), NaN literals and big integers parse as json.loads parses them
    raw = b'{"prompt": "a", "prompt": "hi", "max_tokens": 2, "seed": 100000000000000000000000}'
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    r = client.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2', headers={
        "content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"], r.text
    ok = client.post("/v1/completions", content=json.dumps({"prompt": "a", "max_tokens": 2}).encode(),
                     headers={"content-type": "application/json"})
    assert ok.status_code == 200


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "use_beam_search": True, "n": 11}, "n"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema"),
])
def test_mapping_errors_name_their_field(body, param):
    with pytest.raises((ValidationError, OpenAIServingError)) as e:
        CompletionRequest.model_validate(body).to_sampling_params()
    err = validation_error_to_serving_error(e.value) if isinstance(e.value, ValidationError) else e.value
    assert err.param == param, err


def test_a_body_nested_past_the_parsers_recursion_is_a_400(client):
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = client.post("/v1/completions", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text


# ------------------------------------------------------------------------------------------------- agents' traffic
# (the second audit: streams, Anthropic Messages, Responses, tool calls)


def test_long_string_content_is_no_list_of_parts():
    """max_length on a `str | list` union bounded a string's characters too: any Anthropic message or tool result
    over 1024 characters, any Responses message or function output over 256, was a 400."""
    from tokenspout.entrypoints.anthropic.protocol import InputMessage as AnthropicMessage
    from tokenspout.entrypoints.anthropic.protocol import ToolResultBlock
    from tokenspout.entrypoints.openai.protocol.responses import FunctionCallOutputInput
    from tokenspout.entrypoints.openai.protocol.responses import InputMessage as ResponsesMessage

    long = "x" * 5000
    AnthropicMessage.model_validate({"role": "user", "content": long})
    ToolResultBlock.model_validate({"type": "tool_result", "tool_use_id": "t1", "content": long})
    ResponsesMessage.model_validate({"role": "user", "content": long})
    FunctionCallOutputInput.model_validate({"type": "function_call_output", "call_id": "c", "output": long})
    with pytest.raises(ValidationError):  # the list of parts keeps its bound
        AnthropicMessage.model_validate({"role": "user", "content": [{"type": "text", "text": "a"}] * 5000})


def test_a_stop_string_keeps_stop_where_it_may_have_cut_a_call():
    from tokenspout.engine.chat_output import tool_finish_reason

    assert tool_finish_reason("stop", None, True) == "tool_calls"  # EOS / the grammar complete
    assert tool_finish_reason("stop", 2, True) == "tool_calls"  # a stop token id
    assert tool_finish_reason("stop", "Paris", True) == "stop"  # a stop string the client asked for
    assert tool_finish_reason("length", None, True) == "length"
    assert tool_finish_reason("stop", None, False) == "stop"


def test_anthropic_tool_input_reads_cut_arguments_as_the_client_reads_the_stream():
    from tokenspout.entrypoints.anthropic.protocol import tool_input

    assert tool_input('{"city": "Paris", "days": 2}') == {"city": "Paris", "days": 2}
    assert tool_input('{"city":"Paris","') == {"city": "Paris"}  # what the stream's deltas accumulate to
    assert tool_input("") == {} and tool_input("[1, 2]") == {}


def test_a_required_call_cut_before_its_name_leaks_no_markup():
    from tokenspout.engine.chat_output import ChatOutputParser
    from tokenspout.tool_parsers.hermes import HermesToolParser

    cut = '<tool_call>\n{"name'
    free = ChatOutputParser(HermesToolParser(), None)  # tool_choice auto: text as written stays content
    assert free.final(cut).content == cut
    only = ChatOutputParser(HermesToolParser(), None, calls_only=True)  # required / named: calls only
    parts = only.final(cut)
    assert parts.content == "" and parts.tool_calls == []
    streamed = ChatOutputParser(HermesToolParser(), None, calls_only=True)
    sent = streamed.delta(cut[:5], False).content + streamed.delta(cut[5:], True).content
    assert sent == ""
    whole = only.final('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    assert [c["function"]["name"] for c in whole.tool_calls] == ["f"] and not whole.content


def test_retrieving_a_response_as_a_stream_is_refused(client):
    r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2}).json()
    assert client.get(f"/v1/responses/{r['id']}", params={"stream": "true"}).status_code == 400
    assert client.get(f"/v1/responses/{r['id']}", params={"stream": "false"}).status_code == 200
