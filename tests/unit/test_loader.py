"""Loading errors name what is wrong; nothing is downloaded."""

from __future__ import annotations

import json

import pytest

from tokenspout.config import ModelConfig
from tokenspout.models.loader import load_model


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(ModelConfig(model=str(tmp_path / "nope")))


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(ModelConfig(model=str(tmp_path)))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not supported"):
        load_model(ModelConfig(model=str(tmp_path)))


def _tiny_llama(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)


def test_corrupt_weights(tmp_path):
    _tiny_llama(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(ModelConfig(model=str(tmp_path)))


def test_missing_weights(tmp_path):
    _tiny_llama(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(ModelConfig(model=str(tmp_path)))


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig(dtype="float16").validate()
