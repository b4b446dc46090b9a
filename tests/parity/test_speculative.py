"""Speculative decoding in the engine, for each proposer (n-gram, a draft model -- the default model drafting for
itself -- and self-draft from its first 8 of 30 layers): greedy output identical to plain greedy, exact stop
handling, seeded reproducibility, KV rollback (no leaked blocks)."""

from __future__ import annotations

import pytest

from tests.helpers import run_to_completion
from tokenspout.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from tokenspout.core.engine_core import EngineCore
from tokenspout.engine.messages import EngineCoreRequest
from tokenspout.sampling_params import SamplingParams

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat. "


PROPOSERS = ["ngram", "draft", "self"]


def _spec(loaded, proposer: str | None, k: int) -> SpeculativeConfig:
    if proposer is None:
        return SpeculativeConfig()
    if proposer == "ngram":
        return SpeculativeConfig(method="ngram", num_speculative_tokens=k)
    # Draft proposers draft every step here (adaptive=False): these drafts would not pay, and the policy would
    # soon pause them, but the point is to exercise the draft path.
    if proposer == "draft":
        return SpeculativeConfig(method="draft", draft_model=str(loaded.path), num_speculative_tokens=k,
                                 adaptive=False)
    return SpeculativeConfig(method="draft", draft_layers=8, num_speculative_tokens=k, adaptive=False)


def _core(loaded, proposer: str | bool | None, k: int = 4) -> EngineCore:
    proposer = "ngram" if proposer is True else (proposer or None)
    cfg = EngineConfig(model=ModelConfig(model=str(loaded.path), max_model_len=loaded.max_model_len),
                       cache=CacheConfig(), scheduler=SchedulerConfig(max_num_batched_tokens=1024),
                       speculative=_spec(loaded, proposer, k))
    return EngineCore(cfg, loaded=loaded)


_plain_cache: dict = {}


def _plain(loaded, prompts, params) -> dict[str, list[int]]:
    """Reference outputs without speculation, computed once per (prompts, params) for every proposer's test."""
    key = (tuple(map(tuple, prompts)), repr(params))
    if key not in _plain_cache:
        _plain_cache[key] = run_to_completion(_core(loaded, None), prompts, params)
    return _plain_cache[key]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    chats = [[{"role": "user", "content": f"Repeat this text exactly, twice: {TEXT * (1 + i % 3)}"}]
             for i in range(6)] + [[{"role": "user", "content": "What is the capital of France?"}],
                                   [{"role": "user", "content": "def add(a, b):\n    return a + b\n# rewrite it"}]]
    return [tokenizer(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)).input_ids
            for c in chats]


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_greedy_speculation_is_token_exact(loaded_model, prompts, proposer):
    params = SamplingParams(temperature=0.0, max_tokens=40 if proposer == "ngram" else 24, eos_token_id=2)
    plain = _plain(loaded_model, prompts, params)
    core = _core(loaded_model, proposer)
    spec = run_to_completion(core, prompts, params)
    st = core.stats()
    assert st.spec_num_draft_tokens > 0
    if proposer != "self":  # the first 8 of 30 layers almost never guess the next token (see the README)
        assert st.spec_num_accepted_tokens > 0
    if proposer == "draft":  # the model drafting for itself: its greedy drafts are the target's argmax
        assert st.spec_num_accepted_tokens >= 0.9 * st.spec_num_draft_tokens
    assert spec == plain
    assert core.kv.num_free_blocks == core.kv.num_blocks


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_max_tokens_and_eos_cut_the_accepted_run(loaded_model, prompts, proposer):
    k = 6 if proposer == "ngram" else 4  # (draft forwards cost; 4 still crosses every stop below)
    for max_tokens in (1, 2, 3, 5, 7):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, eos_token_id=2)
        plain = _plain(loaded_model, prompts[:3], params)
        spec = run_to_completion(_core(loaded_model, proposer, k=k), prompts[:3], params)
        assert spec == plain
        assert all(len(v) <= max_tokens for v in spec.values())
    # EOS inside a run: the reference stops at EOS (id 2) before max_tokens; speculation must stop there too.
    params = SamplingParams(temperature=0.0, max_tokens=200, eos_token_id=2)
    plain = _plain(loaded_model, prompts[:2], params)
    spec = run_to_completion(_core(loaded_model, proposer, k=k), prompts[:2], params)
    assert any(v[-1] == 2 and len(v) < 200 for v in plain.values())
    assert spec == plain


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_seeded_speculation_is_reproducible(loaded_model, prompts, proposer):
    n = 32 if proposer == "ngram" else 16
    params = SamplingParams(temperature=0.7, top_p=0.95, seed=11, max_tokens=n, ignore_eos=True)
    core = _core(loaded_model, proposer)
    alone = run_to_completion(core, prompts[:1], params)["0"]
    assert core.stats().spec_num_drafts > 0
    again = run_to_completion(_core(loaded_model, proposer), prompts[:1], params)["0"]
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=i) for i in range(3)]
    batch = run_to_completion(_core(loaded_model, proposer), prompts[5:8] + prompts[:1], others + [params])["3"]
    assert alone == again == batch


def test_rows_with_penalties_or_logprobs_do_not_speculate(loaded_model, prompts):
    core = _core(loaded_model, True)
    core.add_request(EngineCoreRequest("p", prompts[0], SamplingParams(temperature=0.0, max_tokens=20,
                                                                         repetition_penalty=1.2)))
    core.add_request(EngineCoreRequest("l", prompts[1], SamplingParams(temperature=0.0, max_tokens=20, logprobs=2)))
    while core.has_unfinished_requests():
        core.step()
    assert core.stats().spec_num_drafts == 0
