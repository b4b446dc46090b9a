"""Structured output end to end on the default model: every sampled output obeys its grammar."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tokenspout import LLM, SamplingParams
from tokenspout.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm():
    engine = LLM(multiprocess=False, max_model_len=1024, kv_cache_memory=0.25)
    yield engine
    engine.shutdown()


def test_json_schema_fifty_seeded_requests_all_valid(llm):
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=160,
                             structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA)))
              for i in range(50)]
    convs = [[{"role": "user", "content": f"Describe user number {i} as JSON."}] for i in range(50)]
    prompts = [llm.processor.apply_chat_template(c) for c in convs]
    outs = llm.generate(prompts, params)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_regex_choice_json_object(llm):
    regex = r"[A-Z][a-z]{2,8} \d{2}-\d{4}"
    outs = llm.generate(["Name and phone:"] * 8, [SamplingParams(
        temperature=1.0, seed=i, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=regex))
        for i in range(8)])
    assert all(re.fullmatch(regex, o.outputs[0].text) for o in outs), [o.outputs[0].text for o in outs]
    choices = ["red", "green", "blue and yellow"]
    outs = llm.generate(["My favourite colour is"] * 8, [SamplingParams(
        temperature=1.0, seed=i, max_tokens=10, structured_outputs=StructuredOutputsParams(choice=choices))
        for i in range(8)])
    assert all(o.outputs[0].text in choices for o in outs)
    outs = llm.generate(["JSON:"] * 4, [SamplingParams(
        temperature=1.0, seed=i, max_tokens=120,
        structured_outputs=StructuredOutputsParams(json_object=True)) for i in range(4)])
    for o in outs:
        if o.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(o.outputs[0].text), dict)


def test_grammar_rows_mixed_with_plain_rows(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=12)
    alone = llm.generate("The capital of France is", plain)[0].outputs[0].text
    outs = llm.generate(["The capital of France is", "Answer:"], [plain, SamplingParams(
        temperature=1.0, seed=1, max_tokens=10, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))])
    assert outs[0].outputs[0].text == alone
    assert outs[1].outputs[0].text in ("yes", "no")


def test_invalid_grammar_is_a_value_error(llm):
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed")))
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(json='{"type": "nonsense"}')))


def test_openai_response_format_end_to_end():
    from tokenspout.engine.async_llm import AsyncLLM
    from tokenspout.engine.llm import build_engine_config
    from tokenspout.entrypoints.openai.api_server import BackgroundServer, build_app

    engine = AsyncLLM(build_engine_config(None, max_model_len=1024, kv_cache_memory=0.25))
    server = BackgroundServer(build_app(engine)).start()
    try:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        r = c.chat.completions.create(
            model=engine.model_name, messages=[{"role": "user", "content": "A user as JSON."}], seed=3,
            temperature=1.0, max_tokens=160,
            response_format={"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA,
                                                                     "strict": True}})
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        stream = c.chat.completions.create(
            model=engine.model_name, messages=[{"role": "user", "content": "Pick."}], stream=True,
            max_tokens=10, extra_body={"guided_choice": ["alpha", "beta"]})
        text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        assert text in ("alpha", "beta")
        # beam search through the API: n = width, the best beams first; counted in /metrics as a request
        import httpx

        def finished() -> float:
            text = httpx.get(server.url + "/metrics").text
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("tokenspout:request_success_total{"))

        before = finished()
        b = c.completions.create(model=engine.model_name, prompt="The capital of France is", n=3, max_tokens=6,
                                 temperature=0.0, extra_body={"use_beam_search": True})
        assert finished() == before + 3  # one per choice, as sampled ones (beam search was missing)
        assert [ch.index for ch in b.choices] == [0, 1, 2] and len({ch.text for ch in b.choices}) == 3
        assert b.usage.completion_tokens == sum(len(engine.tokenizer(ch.text).input_ids) for ch in b.choices) or \
            b.usage.completion_tokens > 0
        # classifier-free guidance through the API (default negative prompt: the template with an empty message)
        g = c.chat.completions.create(model=engine.model_name, messages=[{"role": "user", "content": "Hi"}],
                                      temperature=0.0, max_tokens=8, extra_body={"guidance_scale": 2.0})
        assert g.usage.completion_tokens >= 1 and g.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model=engine.model_name, messages=[{"role": "user", "content": "x"}],
                                      extra_body={"guidance_scale": -1})
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=engine.model_name, messages=[{"role": "user", "content": "x"}],
                                      extra_body={"guided_regex": "(unclosed"})
        assert "guided_regex" in str(e.value) or "regex" in str(e.value)
        # A grammar no text satisfies (an empty character class after "a"; a dead end the first mask already
        # shows) is a 400 at request time, streamed or not, never a 200 with a forced token.
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                out = c.chat.completions.create(model=engine.model_name, messages=[{"role": "user", "content": "x"}],
                                                max_tokens=4, stream=stream,
                                                extra_body={"guided_regex": "a[^\\x00-\\x{10FFFF}]"})
                if stream:
                    list(out)
            assert "satisfies the grammar" in str(e.value), str(e.value)
        # A grammar satisfied only by the empty string: an empty answer that stops, not an error.
        r = c.chat.completions.create(model=engine.model_name, messages=[{"role": "user", "content": "x"}],
                                      max_tokens=4, extra_body={"guided_regex": ""})
        assert r.choices[0].message.content == "" and r.choices[0].finish_reason == "stop"
        # A counted repetition past llguidance's lexer limit passes validation (the grammar expands lazily) and
        # breaks on the first token: a 400 naming the field, not a 200 that finishes "abort" (audit, s30).
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                out = c.chat.completions.create(model=engine.model_name, messages=[{"role": "user", "content": "x"}],
                                                max_tokens=4, stream=stream, extra_body={"guided_regex": "a{1000000}"})
                if stream:
                    list(out)
            assert "guided_regex is invalid" in str(e.value) and "limit" in str(e.value), str(e.value)
            if not stream:
                assert e.value.body["param"] == "guided_regex"
        # Invalid constraints name the field the client sent
        for body, param in (({"guided_regex": "(a"}, "guided_regex"), ({"guided_regex": "a\\"}, "guided_regex"),
                            ({"response_format": {"type": "json_schema", "json_schema": {
                                "name": "x", "schema": {"type": "nope"}}}}, "response_format"),
                            ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex")):
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(model=engine.model_name, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=4, extra_body=body)
            assert e.value.body["param"] == param, (body, e.value.body)
        # Beam search checks max_tokens against the prompt's room at once, as sampling does
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=engine.model_name, prompt="Hi", n=2, max_tokens=5000,
                                 extra_body={"use_beam_search": True})
        assert e.value.body["param"] == "max_tokens"
    finally:
        server.stop()
        engine.shutdown()
