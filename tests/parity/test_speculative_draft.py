"""Draft-model and self-draft speculation: configuration errors, vocabulary checks, KV budget, and exactness of
sampled output through the real engine path (a tiny target and a different tiny draft, so q is far from p and
rejections, recoveries and bonus tokens all happen) against the target's exact distribution from transformers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from tests.helpers import run_to_completion
from tests.stats.chi2 import gof
from tokenspout.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from tokenspout.core.engine_core import EngineCore
from tokenspout.entrypoints.cli import main as cli_main
from tokenspout.models.loader import load_model
from tokenspout.sampling_params import SamplingParams

VOCAB = 8
PROMPT = [1, 2, 3]
TEMPERATURE = 0.8


def _tiny(path, seed: int, vocab: int = VOCAB, words: list[str] | None = None, layers: int = 2):
    """A tiny random Llama with a word-level tokenizer (so two folders can share, or not share, a tokenizer)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      initializer_range=0.5, tie_word_embeddings=False)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(path)
    words = words or [f"w{i}" for i in range(vocab)]
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(dict(zip(words, range(vocab))),
                                                                       unk_token=words[0])))
    tok.save_pretrained(path)
    return hf


def _engine(target_path, spec: SpeculativeConfig, **sched) -> EngineCore:
    cfg = EngineConfig(model=ModelConfig(model=str(target_path)), cache=CacheConfig(num_gpu_blocks_override=1200),
                       scheduler=SchedulerConfig(**sched), speculative=spec)
    return EngineCore(cfg)


def test_config_errors():
    for bad in (SpeculativeConfig(method="draft"), SpeculativeConfig(method="draft", draft_model="x", draft_layers=2),
                SpeculativeConfig(method="ngram", draft_layers=2), SpeculativeConfig(method="draft", draft_layers=0),
                SpeculativeConfig(method="eagle")):
        with pytest.raises(ValueError):
            bad.validate()
    SpeculativeConfig(method="draft", draft_layers=3).validate()


def test_draft_layers_out_of_range(tmp_path):
    _tiny(tmp_path, 0)
    with pytest.raises(ValueError, match="draft_layers must be in \\[1, 1\\]"):
        _engine(tmp_path, SpeculativeConfig(method="draft", draft_layers=2))


def test_draft_model_must_share_the_vocabulary(tmp_path):
    _tiny(tmp_path / "target", 0)
    _tiny(tmp_path / "bigger", 1, vocab=VOCAB + 4)
    with pytest.raises(ValueError, match="vocab_size"):
        _engine(tmp_path / "target", SpeculativeConfig(method="draft", draft_model=str(tmp_path / "bigger")))
    _tiny(tmp_path / "other", 1, words=[f"x{i}" for i in range(VOCAB)])  # same size, different tokens
    with pytest.raises(ValueError, match="different tokenizer"):
        _engine(tmp_path / "target", SpeculativeConfig(method="draft", draft_model=str(tmp_path / "other")))


def test_draft_kv_cache_counts_against_the_budget(tmp_path):
    _tiny(tmp_path / "target", 0)
    _tiny(tmp_path / "draft", 1, layers=1)
    def blocks(spec):
        cfg = EngineConfig(model=ModelConfig(model=str(tmp_path / "target")),
                           cache=CacheConfig(kv_cache_memory_gib=0.01), speculative=spec)
        return EngineCore(cfg).runner.num_blocks
    alone = blocks(SpeculativeConfig())
    # The draft has half the target's layers (same KV width): the shared block count drops to 2/3 (each count is
    # the budget floored to whole blocks, so the two floors may differ by one block).
    assert abs(blocks(SpeculativeConfig(method="draft", draft_model=str(tmp_path / "draft"))) - alone * 2 / 3) <= 1
    assert blocks(SpeculativeConfig(method="draft", draft_layers=1)) == alone  # self-draft: no second cache


def test_cli_rejects_bad_speculative_flags(tmp_path):
    _tiny(tmp_path, 0)
    assert cli_main(["generate", "hi", "--model", str(tmp_path), "--speculative", "draft"]) == 2
    assert cli_main(["generate", "hi", "--model", str(tmp_path), "--speculative", "draft",
                     "--draft-model", str(tmp_path / "missing")]) == 2


def _exact_joint(hf, prefix_len: int) -> np.ndarray:
    """P(t1..t_n) for every sequence of n = prefix_len tokens after PROMPT, at TEMPERATURE, from transformers."""
    seqs = [list(s) for s in itertools.product(range(VOCAB), repeat=prefix_len)]
    ids = torch.tensor([PROMPT + s for s in seqs])
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits.double() / TEMPERATURE, -1)
    n0 = len(PROMPT) - 1
    lp = sum(logp[torch.arange(len(seqs)), n0 + j, ids[:, n0 + j + 1]] for j in range(prefix_len))
    return lp.exp().numpy()


@pytest.mark.parametrize("self_draft", [False, True])
def test_sampled_speculation_is_exact_through_the_engine(tmp_path, self_draft):
    """8,000 seeded requests, 4 tokens each with k = 2 drafts (drafts for tokens 2-3, bonus token 4, or recovery
    and another round): the joint law of tokens 2-3 and the marginal of token 4 match the target's (alpha 0.001).
    Tokens 2.. come out of verification rounds with a real q (adaptive=False: every request drafts every step)."""
    hf = _tiny(tmp_path / "target", 0, layers=3)
    if self_draft:
        spec = SpeculativeConfig(method="draft", draft_layers=1, num_speculative_tokens=2, adaptive=False)
    else:
        _tiny(tmp_path / "draft", 7, layers=1)
        spec = SpeculativeConfig(method="draft", draft_model=str(tmp_path / "draft"), num_speculative_tokens=2,
                                 adaptive=False)
    core = _engine(tmp_path / "target", spec, max_num_seqs=1024, max_num_batched_tokens=8192)
    n = 8000
    params = [SamplingParams(temperature=TEMPERATURE, max_tokens=4, ignore_eos=True, seed=i) for i in range(n)]
    out = run_to_completion(core, [PROMPT] * n, params)
    st = core.stats()
    assert st.spec_num_drafts > n // 2 and 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens
    toks = torch.tensor([out[str(i)] for i in range(n)])
    joint4 = _exact_joint(hf, 4).reshape([VOCAB] * 4)
    p23 = joint4.sum(axis=(0, 3)).reshape(-1)
    p4 = joint4.sum(axis=(0, 1, 2))
    assert gof(toks[:, 1] * VOCAB + toks[:, 2], p23) > 1e-3
    assert gof(toks[:, 3], p4) > 1e-3
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_tiny_draft_model_greedy_is_exact(tmp_path):
    """Greedy with a different draft model (many rejections) equals greedy without speculation."""
    _tiny(tmp_path / "target", 0, layers=3)
    _tiny(tmp_path / "draft", 7, layers=1)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (m,), generator=gen).tolist() for m in (3, 9, 20, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = run_to_completion(_engine(tmp_path / "target", SpeculativeConfig()), prompts, params)
    spec = SpeculativeConfig(method="draft", draft_model=str(tmp_path / "draft"), num_speculative_tokens=3,
                             adaptive=False)
    core = _engine(tmp_path / "target", spec, max_num_batched_tokens=16)  # chunked prefill too
    assert run_to_completion(core, prompts, params) == plain
    st = core.stats()
    assert 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens
    assert load_model(ModelConfig(model=str(tmp_path / "draft"))).arch.num_layers == 1
