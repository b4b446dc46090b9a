"""Speculative decoding in the engine: greedy output identical to plain greedy, exact stop handling, seeded
reproducibility, KV rollback (no leaked blocks)."""

from __future__ import annotations

import pytest

from tests.helpers import run_to_completion
from tokenspout.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from tokenspout.core.engine_core import EngineCore
from tokenspout.engine.messages import EngineCoreRequest
from tokenspout.sampling_params import SamplingParams

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat. "


def _core(loaded, spec: bool, k: int = 4) -> EngineCore:
    cfg = EngineConfig(model=ModelConfig(model=str(loaded.path), max_model_len=loaded.max_model_len),
                       cache=CacheConfig(), scheduler=SchedulerConfig(max_num_batched_tokens=1024),
                       speculative=SpeculativeConfig(method="ngram" if spec else None, num_speculative_tokens=k))
    return EngineCore(cfg, loaded=loaded)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    chats = [[{"role": "user", "content": f"Repeat this text exactly, twice: {TEXT * (1 + i % 3)}"}]
             for i in range(6)] + [[{"role": "user", "content": "What is the capital of France?"}],
                                   [{"role": "user", "content": "def add(a, b):\n    return a + b\n# rewrite it"}]]
    return [tokenizer(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)).input_ids
            for c in chats]


def test_greedy_speculation_is_token_exact(loaded_model, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=40, eos_token_id=2)
    plain = run_to_completion(_core(loaded_model, False), prompts, params)
    core = _core(loaded_model, True)
    spec = run_to_completion(core, prompts, params)
    st = core.stats()
    assert st.spec_num_draft_tokens > 0 and st.spec_num_accepted_tokens > 0
    assert spec == plain
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_max_tokens_and_eos_cut_the_accepted_run(loaded_model, prompts):
    for max_tokens in (1, 2, 3, 5, 7):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, eos_token_id=2)
        plain = run_to_completion(_core(loaded_model, False), prompts[:3], params)
        spec = run_to_completion(_core(loaded_model, True, k=6), prompts[:3], params)
        assert spec == plain
        assert all(len(v) <= max_tokens for v in spec.values())
    # EOS inside a run: the reference stops at EOS (id 2) before max_tokens; speculation must stop there too.
    params = SamplingParams(temperature=0.0, max_tokens=200, eos_token_id=2)
    plain = run_to_completion(_core(loaded_model, False), prompts[:2], params)
    spec = run_to_completion(_core(loaded_model, True, k=6), prompts[:2], params)
    assert any(v[-1] == 2 and len(v) < 200 for v in plain.values())
    assert spec == plain


def test_seeded_speculation_is_reproducible(loaded_model, prompts):
    params = SamplingParams(temperature=0.7, top_p=0.95, seed=11, max_tokens=32, ignore_eos=True)
    alone = run_to_completion(_core(loaded_model, True), prompts[:1], params)["0"]
    again = run_to_completion(_core(loaded_model, True), prompts[:1], params)["0"]
    others = [SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, seed=i) for i in range(5)]
    batch = run_to_completion(_core(loaded_model, True), prompts[3:8] + prompts[:1], others + [params])["5"]
    assert alone == again == batch


def test_rows_with_penalties_or_logprobs_do_not_speculate(loaded_model, prompts):
    core = _core(loaded_model, True)
    core.add_request(EngineCoreRequest("p", prompts[0], SamplingParams(temperature=0.0, max_tokens=20,
                                                                         repetition_penalty=1.2)))
    core.add_request(EngineCoreRequest("l", prompts[1], SamplingParams(temperature=0.0, max_tokens=20, logprobs=2)))
    while core.has_unfinished_requests():
        core.step()
    assert core.stats().spec_num_drafts == 0
