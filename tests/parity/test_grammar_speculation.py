"""Structured output under n-gram speculative decoding: drafts are cut to what the grammar accepts, every verified
position is masked by the grammar advanced over the drafts before it, and the grammar advances by exactly the
emitted tokens.  Greedy output equals greedy output without speculation; sampled output still obeys the grammar."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.helpers import run_to_completion
from tokenspout.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from tokenspout.core.engine_core import EngineCore
from tokenspout.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 16},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}
PEOPLE = ['{"name":"Alice Smith","age":34,"city":"Lisbon","tags":["red","blue","green"]}',
          '{"name":"Bob Stone","age":51,"city":"Osaka","tags":["chess","tea"]}',
          '{"name":"Carla Diaz","age":27,"city":"Lima","tags":["surf","music","code"]}']
REGEX = r"([a-z]+ ){3,14}[a-z]+\."
SENTENCES = ["the cat sat on the mat and the dog sat on the log.", "one two three four five six seven eight.",
             "we walk to the park and we walk to the shop."]


def _core(loaded, spec: bool) -> EngineCore:
    # min_mean_emitted 0: never pause drafting, so every step of these short outputs is verified.
    cfg = EngineConfig(model=ModelConfig(model=str(loaded.path), max_model_len=loaded.max_model_len),
                       cache=CacheConfig(num_gpu_blocks_override=256),
                       scheduler=SchedulerConfig(max_num_batched_tokens=1024),
                       speculative=SpeculativeConfig(method="ngram" if spec else None, num_speculative_tokens=4,
                                                     min_mean_emitted=0.0, min_mean_emitted_batched=0.0))
    return EngineCore(cfg, loaded=loaded)


def _chat(tokenizer, text: str) -> list[int]:
    s = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=False)
    return tokenizer(s).input_ids


@pytest.fixture(scope="module")
def cases(tokenizer):
    json_params = StructuredOutputsParams(json=json.dumps(SCHEMA))
    regex_params = StructuredOutputsParams(regex=REGEX)
    prompts = ([_chat(tokenizer, f"Repeat this JSON exactly: {p}") for p in PEOPLE]
               + [_chat(tokenizer, f"Repeat this sentence twice: {s} {s}") for s in SENTENCES])
    specs = [json_params] * len(PEOPLE) + [regex_params] * len(SENTENCES)
    return prompts, specs


def test_greedy_grammar_output_is_unchanged_by_speculation(loaded_model, tokenizer, cases):
    prompts, specs = cases
    params = [SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=s) for s in specs]
    plain = run_to_completion(_core(loaded_model, False), prompts, params)
    core = _core(loaded_model, True)
    spec = run_to_completion(core, prompts, params)
    st = core.stats()
    assert st.spec_num_drafts > 0 and st.spec_num_accepted_tokens > 0  # the grammar rows did speculate
    assert spec == plain
    assert core.kv.num_free_blocks == core.kv.num_blocks
    assert core.structured.get().num_requests == 0
    for i, p in enumerate(PEOPLE):
        assert json.loads(tokenizer.decode(spec[str(i)], skip_special_tokens=True)) == json.loads(p)
    for i in range(len(PEOPLE), len(prompts)):
        assert re.fullmatch(REGEX, tokenizer.decode(spec[str(i)], skip_special_tokens=True))


def test_sampled_grammar_output_stays_valid_with_speculation(loaded_model, tokenizer, cases):
    prompts, specs = cases
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=48, structured_outputs=s)
              for i, s in enumerate(specs * 2)]
    core = _core(loaded_model, True)
    out = run_to_completion(core, prompts * 2, params)
    assert core.stats().spec_num_accepted_tokens > 0
    ended = [i for i in range(len(params)) if len(out[str(i)]) < 48]  # by the grammar, not cut by max_tokens
    assert len(ended) >= len(params) - 2
    for i in ended:
        text = tokenizer.decode(out[str(i)], skip_special_tokens=True)
        if specs[i % len(specs)].json is not None:
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert re.fullmatch(REGEX, text), text
