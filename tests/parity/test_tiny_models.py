"""Parity with transformers on tiny random-initialised Llama-family models saved to temporary folders
(Qwen2 with QKV bias, Qwen3 with q/k norms and a head_dim that is not hidden/heads, Llama with llama3 and linear
RoPE scaling, Mistral; tied and untied embeddings; GQA; one sharded checkpoint).  No download."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import make_core, run_to_completion
from tokenspout.config import ModelConfig
from tokenspout.models.loader import load_model
from tokenspout.sampling_params import SamplingParams

COMMON = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 256, "initializer_range": 0.3, "rms_norm_eps": 1e-6}


def _configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        "qwen2": Qwen2Config(**COMMON, tie_word_embeddings=False),
        "qwen3": Qwen3Config(**{**COMMON, "num_key_value_heads": 1}, head_dim=32, tie_word_embeddings=True),
        "llama3-rope": LlamaConfig(**COMMON, tie_word_embeddings=True, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}),
        "linear-rope-sharded": LlamaConfig(**COMMON, rope_scaling={"rope_type": "linear", "factor": 2.0}),
        "mistral": MistralConfig(**{**COMMON, "num_key_value_heads": 4}, sliding_window=None),
    }


@pytest.mark.parametrize("name", list(_configs()))
def test_tiny_model_parity(name, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = _configs()[name]
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(tmp_path, max_shard_size="100KB" if "sharded" in name else "1GB")
    if "sharded" in name:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = load_model(ModelConfig(model=str(tmp_path)))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (5, 17, 40, 70)]
    core = make_core(loaded, budget=32, block_size=8)
    captured: dict[str, list[torch.Tensor]] = {}
    core.runner.logits_hook = lambda ids, lg: [captured.setdefault(r, []).append(lg[i].clone())
                                               for i, r in enumerate(ids)]
    ours = run_to_completion(core, prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            g = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, output_logits=True,
                            return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
        ref = g.sequences[0, len(ids):].tolist()
        assert ours[str(i)] == ref, f"{name} prompt {i}"
        err = (captured[str(i)][0] - g.logits[0][0]).abs().max().item()
        assert err < 1e-4, f"{name} prompt {i}: first-step logit error {err:.2e}"
