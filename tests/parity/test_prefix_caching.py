"""Automatic prefix caching in the engine: requests that start from cached blocks compute fewer prompt tokens and
produce exactly what they produce with caching off (greedy), under preemption, with CFG and with a grammar."""

from __future__ import annotations

import json

import torch

from tests.helpers import make_core, run_to_completion
from tokenspout.engine.messages import EngineCoreRequest
from tokenspout.sampling_params import SamplingParams, StructuredOutputsParams

SYSTEM = ("You are a careful assistant. Answer in one short sentence, state facts only, and never invent details "
          "you are not sure about. The user is curious about geography and history, and likes to learn about "
          "rivers, mountains, seas and the capital cities of the world. Keep every answer polite and plain. ")
QUESTIONS = ["What is the capital of France?", "Which river flows through Cairo?", "Where is Mount Fuji?",
             "What sea lies north of Turkey?"]


def _chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    return tokenizer(text).input_ids


def _prompts(tokenizer) -> list[list[int]]:
    return [_chat(tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
            for q in QUESTIONS]


def _one_by_one(core, prompts, params) -> tuple[dict[str, list[int]], dict[str, int], dict[str, int]]:
    """Runs the prompts one after another (each finishes before the next arrives, so later ones can hit the
    blocks of earlier ones); returns the tokens, the cached prompt tokens reported, and the tokens the model
    computed for each request's prompt."""
    computed: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for i, ids in enumerate(prompts):
        rid = str(i)
        core.add_request(EngineCoreRequest(rid, ids, params))
        tokens[rid], computed[rid] = [], 0
        while core.has_unfinished_requests():
            sched = core.scheduler.schedule()
            for e in sched.scheduled:
                if e.request.request_id == rid and e.request.num_output_tokens == 0:
                    computed[rid] += e.num_new_tokens
            result = core.runner.execute(sched)
            for o in core.scheduler.update_from_output(sched, result):
                tokens[o.request_id] += o.new_token_ids
                cached[o.request_id] = o.num_cached_tokens
    return tokens, cached, computed


def test_common_prompt_is_computed_once_and_output_is_unchanged(loaded_model, tokenizer):
    prompts = _prompts(tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    logits: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    results = {}
    for on in (False, True):
        core = make_core(loaded_model, prefix_caching=on)
        core.runner.logits_hook = lambda ids, lg, on=on: logits[on].append(lg[0].clone())
        results[on] = _one_by_one(core, prompts, params)
        assert core.kv.num_free_blocks == core.kv.num_blocks
    (off_tokens, off_cached, off_computed), (on_tokens, on_cached, on_computed) = results[False], results[True]
    assert on_tokens == off_tokens
    assert all(v == 0 for v in off_cached.values())
    assert off_computed == {str(i): len(p) for i, p in enumerate(prompts)}
    common = len(_chat(tokenizer, [{"role": "system", "content": SYSTEM}], add_generation_prompt=False))
    assert common >= 48
    assert on_cached["0"] == 0 and on_computed["0"] == len(prompts[0])
    for i, p in enumerate(prompts[1:], 1):
        # at least every full block of the common system prompt is reused
        assert on_cached[str(i)] >= common // 16 * 16, i
        assert on_computed[str(i)] == len(p) - on_cached[str(i)]
    # Reading cached KV instead of recomputing it changes no logit beyond float noise.
    assert len(logits[True]) == len(logits[False])
    assert max((a - b).abs().max().item() for a, b in zip(logits[True], logits[False])) < 1e-4


def test_preemption_resumes_from_cached_blocks(loaded_model, tokenizer):
    prompts = _prompts(tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    free = run_to_completion(make_core(loaded_model, prefix_caching=False), prompts, params)
    # 8 blocks of 16 tokens: the shared system prompt fits, but not four ~100-token tails at once.
    core = make_core(loaded_model, num_blocks=8)
    pressured = run_to_completion(core, prompts, params)
    assert core.scheduler.num_preemptions > 0
    assert core.stats().prefix_cache_hits > 0
    assert pressured == free
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_cfg_and_grammar_requests_share_blocks_exactly(loaded_model, tokenizer):
    prompts = _prompts(tokenizer)
    neg = _chat(tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ""}])
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 24}},
              "required": ["answer"], "additionalProperties": False}
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, guidance_scale=1.5,
                             negative_prompt_token_ids=neg),
              SamplingParams(temperature=0.0, max_tokens=16,
                             structured_outputs=StructuredOutputsParams(json=json.dumps(schema)))]
    # Each twice, the copies a step apart, so they run against cached blocks of the first (companions' included).
    outs = {}
    for on in (False, True):
        core = make_core(loaded_model, prefix_caching=on)
        arrivals = list(enumerate(zip(prompts[:2] * 2, params * 2)))
        got: dict[str, list[int]] = {str(i): [] for i, _ in arrivals}
        while arrivals or core.has_unfinished_requests():
            if arrivals:
                i, (ids, p) = arrivals.pop(0)
                core.add_request(EngineCoreRequest(str(i), ids, p))
            for o in core.step().outputs:
                got[o.request_id] += o.new_token_ids
        outs[on] = got
        assert core.kv.num_free_blocks == core.kv.num_blocks
        if on:
            assert core.stats().prefix_cache_hits > 0
    assert outs[True] == outs[False]
    assert outs[True]["0"] and outs[True]["1"] == outs[True]["3"]
    json.loads(tokenizer.decode(outs[True]["1"]))
