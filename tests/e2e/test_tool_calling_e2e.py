"""Tool calling over HTTP with the official openai client, on the default model with a tool-capable ChatML
template (tests/data/chatml_tools.jinja, Hermes format; --tool-call-parser auto picks hermes from it).

Oracles: jsonschema validates every call's arguments against its function's schema; the non-streamed response is
the oracle of the streamed one (same seed); the rendered prompt (return_token_ids, decoded by transformers'
tokenizer) shows what reached the template."""

from __future__ import annotations

import concurrent.futures
import json

import jsonschema
import openai
import pytest

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers", "strict": True,
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def engine(tools_server):
    return tools_server[0]


@pytest.fixture(scope="module")
def server(tools_server):
    return tools_server[1]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(engine):
    return engine.model_name


def ask(client, model, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", MAX_TOKENS)
    return client.chat.completions.create(model=model, tools=TOOLS, **kw)


def check_call(call, allowed: set[str]) -> None:
    assert call.type == "function" and call.id
    assert call.function.name in allowed
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def many(fn, seeds):
    with concurrent.futures.ThreadPoolExecutor(10) as pool:  # concurrent: the engine batches them
        return list(pool.map(fn, seeds))


def check_reply(choice, allowed: set[str]) -> None:
    """Every call parses and validates; only a last call that max_tokens cut (finish_reason length) may be
    incomplete (returned as far as it was written, as OpenAI does)."""
    calls = choice.message.tool_calls
    assert calls, choice
    assert choice.finish_reason in ("tool_calls", "length")
    complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]
    for call in complete:
        check_call(call, allowed)
    if choice.finish_reason == "tool_calls":
        assert not choice.message.content  # calls only


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_constrained_calls_parse_and_validate_over_20_seeds(client, model, tool_choice):
    allowed = set(SCHEMAS) if tool_choice == "required" else {"add"}
    one = many(lambda s: ask(client, model, tool_choice=tool_choice, temperature=1.0, seed=s,
                             parallel_tool_calls=False), range(20))
    for r in one:  # one call each: it always completes within max_tokens
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        check_reply(choice, allowed)
    parallel = many(lambda s: ask(client, model, tool_choice=tool_choice, temperature=1.0, seed=s), range(20))
    for r in parallel:  # the model may go on calling until max_tokens cuts a call
        check_reply(r.choices[0], allowed)


def reassemble(stream):
    content, calls, finish, ids = "", {}, None, set()
    for chunk in stream:
        for d in chunk.choices:
            content += d.delta.content or ""
            for tc in d.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    assert entry["id"] is None, "a call's id comes once, in its first delta"
                    entry["id"] = tc.id
                    ids.add(tc.id)
                    assert tc.function.name, "the first delta names the function"
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            finish = d.finish_reason or finish
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], finish, ids


@pytest.mark.parametrize("tool_choice", ["required", "auto", {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("seed", [1, 2])
def test_a_streamed_call_reassembles_to_the_non_streamed_one(client, model, tool_choice, seed):
    kw = {"tool_choice": tool_choice, "temperature": 1.0, "seed": seed}
    whole = ask(client, model, **kw).choices[0]
    content, calls, finish, ids = reassemble(ask(client, model, stream=True, **kw))
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert content == (whole.message.content or "")
    assert finish == whole.finish_reason
    assert len(ids) == len(calls)
    assert "<tool_call" not in content  # no half-parsed marker leaks into the text


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_parallel_tool_calls_false_yields_at_most_one_call(client, model, tool_choice):
    kw = {"tool_choice": tool_choice, "parallel_tool_calls": False, "temperature": 1.0}
    rs = many(lambda s: ask(client, model, seed=200 + s, **kw), range(8))
    for r in rs:
        assert len(r.choices[0].message.tool_calls or []) <= 1
    assert any(r.choices[0].message.tool_calls for r in rs) or tool_choice == "auto"
    streamed = reassemble(ask(client, model, seed=200, stream=True, **kw))
    assert len(streamed[1]) <= 1


def test_auto_calls_validate_or_answer_in_text(client, model):
    rs = many(lambda s: ask(client, model, tool_choice="auto", temperature=1.0, seed=300 + s), range(8))
    for r in rs:
        choice = r.choices[0]
        for call in choice.message.tool_calls or []:
            check_call(call, set(SCHEMAS))
        if not choice.message.tool_calls:
            assert choice.finish_reason in ("stop", "length") and "<tool_call>" not in (choice.message.content or "")


def test_a_two_turn_exchange_renders_every_field(client, model, tokenizer):
    first = ask(client, model, tool_choice="required", temperature=0.0).choices[0].message
    call = first.tool_calls[0]
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'}]
    r = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none",
                                       max_tokens=16, temperature=0.0, extra_body={"return_token_ids": True})
    prompt = tokenizer.decode(r.prompt_token_ids)
    args = json.loads(call.function.arguments)
    assert '"name": "get_weather"' in prompt and '"name": "add"' in prompt  # the tool definitions
    assert f'<tool_call>\n{{"name": "{call.function.name}", "arguments": ' in prompt  # the assistant's call
    assert all(json.dumps(v) in prompt for v in args.values())  # its arguments, as an object
    assert '<tool_response>\n{"temperature": 21, "sky": "sunny"}\n</tool_response>' in prompt  # the tool result
    answer = r.choices[0]
    assert answer.message.tool_calls == [] and answer.finish_reason in ("stop", "length")
    assert isinstance(answer.message.content, str)


def test_tool_choice_none_renders_tools_but_never_parses(client, model):
    r = ask(client, model, tool_choice="none", temperature=0.0, max_tokens=8).choices[0]
    assert r.message.tool_calls == [] and r.finish_reason in ("stop", "length")


@pytest.mark.parametrize("kw, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required", "tools": []}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}}}}}]},
     "tools"),
])
def test_bad_tool_requests_are_400s_naming_the_field(client, model, kw, param):
    kw = {"tools": TOOLS, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, **kw)
    assert e.value.status_code == 400 and param in str(e.value), str(e.value)
    assert e.value.body["param"] == param, e.value.body


def test_a_template_without_tool_support_is_a_400_naming_the_template(client, model, engine):
    own = engine.tokenizer.chat_template  # SmolLM2's own template never reads `tools`
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=4,
                                       extra_body={"chat_template": own})
    assert "chat template does not render tools" in str(e.value) and "--chat-template" in str(e.value)
    # tool_choice "none" needs no tool support: the tools are simply not rendered.
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4,
                                       extra_body={"chat_template": own})
    assert r.choices[0].message.tool_calls == []


def test_tokenize_with_tools_counts_the_chat_prompt(client, model, server):
    import httpx

    r = ask(client, model, tool_choice="none", temperature=0.0, max_tokens=1)
    count = httpx.post(server.url + "/tokenize", json={"messages": ASK, "tools": TOOLS}, timeout=60).json()["count"]
    bare = httpx.post(server.url + "/tokenize", json={"messages": ASK}, timeout=60).json()["count"]
    assert count == r.usage.prompt_tokens and count > bare + 50  # the tool definitions are in the prompt
    dup = httpx.post(server.url + "/tokenize", json={"messages": ASK, "tools": [TOOLS[0], TOOLS[0]]}, timeout=60)
    assert dup.status_code == 400 and dup.json()["error"]["param"] == "tools"


DEFS_SCHEMA = {  # pydantic's shape for nested models: local $defs, referenced from the root
    "type": "object",
    "properties": {"place": {"$ref": "#/$defs/Place"}, "unit": {"$ref": "#/definitions/Unit"}},
    "required": ["place", "unit"],
    "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                        "required": ["city"], "additionalProperties": False}},
    "definitions": {"Unit": {"enum": ["celsius", "fahrenheit"]}},
}


def test_parameters_with_defs_and_refs_are_enforced(client, model):
    """vLLM-test finding: a tool whose parameters use local $defs / $ref was a 400 (the schema is nested inside the
    call's grammar, where root-relative pointers broke); now the call validates against it."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": DEFS_SCHEMA}},
             {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]
    r = client.chat.completions.create(model=model, messages=ASK, tools=tools, max_tokens=MAX_TOKENS, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), DEFS_SCHEMA)


BOUNDED = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},  # qwen3_coder's text runs on
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}


@pytest.mark.parametrize("parser", ["pythonic", "qwen3_coder"])
def test_more_parsers_constrain_and_parse_calls(engine, model, parser):
    """--tool-call-parser pythonic (Llama 3.2 / 4's `[get_weather(city="...")]`) and qwen3_coder (Qwen3-Coder's
    `<function=...><parameter=...>` XML) on the real model: the grammar makes the tiny model write the format,
    which comes back as an OpenAI tool call whose arguments follow the schema, streamed and not."""
    from tests.helpers import background_server

    with background_server(engine, tool_call_parser=parser) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300)
        tools = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "parameters": BOUNDED}}, TOOLS[1]]
        kw = dict(model=model, messages=ASK, tools=tools, tool_choice="required", max_tokens=MAX_TOKENS,
                  temperature=0, parallel_tool_calls=False)
        r = client.chat.completions.create(**kw)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
        assert call.function.name == tools[0]["function"]["name"]
        jsonschema.validate(json.loads(call.function.arguments), BOUNDED)
        args, name = "", None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for tc in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                name = name or tc.function.name
                args += tc.function.arguments or ""
        assert (name, args) == (call.function.name, call.function.arguments)


def test_qwen3_reasoning_parser_still_enforces_calls_and_formats(engine, model):
    """vLLM-test finding: with --reasoning-parser qwen3, tool_choice "required" and response_format were enforced
    only after a </think> -- and a reply that does not open with <think> (this model never writes one) came back
    as free text.  Now the grammar applies from the first token unless the reply opens with <think>."""
    from tests.helpers import background_server

    with background_server(engine, reasoning_parser="qwen3") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300)
        r = client.chat.completions.create(model=model, messages=ASK, tools=[TOOLS[0]], tool_choice="required",
                                           max_tokens=MAX_TOKENS, temperature=0, parallel_tool_calls=False)
        (call,) = r.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                  "required": ["city"], "additionalProperties": False}
        r = client.chat.completions.create(model=model, messages=ASK, max_tokens=MAX_TOKENS, temperature=0,
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "city", "schema": schema}})
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
