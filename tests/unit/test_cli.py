"""Command-line flags map to engine settings as documented."""

from __future__ import annotations

import argparse

import pytest

from tokenspout.entrypoints.cli import add_engine_args, engine_kwargs


def kwargs(*argv: str) -> dict:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_kwargs(p.parse_args(list(argv)))


def test_quantization_auto_is_int4_for_the_default_model_only():
    assert kwargs()["quantization"] == "int4"
    assert kwargs("--model", "/some/folder")["quantization"] is None
    assert kwargs("--quantization", "none")["quantization"] == "none"  # (build_engine_config: float weights,
    # where a bare None would mean a GGUF file's own format)
    assert kwargs("--model", "/m", "--quantization", "int8")["quantization"] == "int8"
    assert kwargs()["dtype"] == "auto"


def test_bad_quantization_flag_is_refused():
    with pytest.raises(SystemExit):
        kwargs("--quantization", "int3")


def test_activation_quant_flag():
    """int16 by default (float32-level results); int8 only when asked; anything else refused, also by the config."""
    from tokenspout.config import ModelConfig

    assert kwargs()["activation_quant"] == "int16"
    assert kwargs("--activation-quant", "int8")["activation_quant"] == "int8"
    with pytest.raises(SystemExit):
        kwargs("--activation-quant", "int4")
    with pytest.raises(ValueError, match="activation_quant"):
        ModelConfig(activation_quant="fp8").validate()
    from tokenspout.engine.llm import build_engine_config

    cfg = build_engine_config(**{k: v for k, v in kwargs("--activation-quant", "int8").items()
                                 if k in ("quantization", "activation_quant")})
    assert (cfg.model.quantization, cfg.model.activation_quant) == ("int4", "int8")
    with pytest.raises(ValueError, match="activation_quant"):
        build_engine_config(activation_quant="int4")


def test_prefix_caching_is_on_by_default_and_can_be_turned_off():
    assert kwargs()["enable_prefix_caching"] is True
    assert kwargs("--no-enable-prefix-caching")["enable_prefix_caching"] is False
    assert kwargs("--enable-prefix-caching")["enable_prefix_caching"] is True


def test_speculative_flags_reach_the_engine():
    k = kwargs("--speculative", "ngram", "--num-speculative-tokens", "3", "--ngram-min", "1", "--ngram-max", "5")
    assert (k["speculative"], k["num_speculative_tokens"], k["ngram_min"], k["ngram_max"]) == ("ngram", 3, 1, 5)
    assert kwargs()["speculative"] is None


def test_kv_cache_dtype_flag():
    # the server's auto: a float16 cache for a float32 model (llama.cpp's default), the model's dtype for bf16
    assert kwargs()["kv_cache_dtype"] == "float16"
    assert kwargs("--dtype", "float32")["kv_cache_dtype"] == "float16"
    assert kwargs("--dtype", "bfloat16")["kv_cache_dtype"] == "auto"
    assert kwargs("--kv-cache-dtype", "model")["kv_cache_dtype"] == "auto"
    assert kwargs("--kv-cache-dtype", "float16")["kv_cache_dtype"] == "float16"
    with pytest.raises(SystemExit):
        kwargs("--kv-cache-dtype", "int8")
    from tokenspout.config import CacheConfig

    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="fp8").validate()


def test_async_scheduling_flag():
    assert kwargs()["async_scheduling"] is False
    assert kwargs("--async-scheduling")["async_scheduling"] is True


def test_cache_and_scheduler_defaults_are_the_engine_configs():
    """The CLI and the LLM API take their cache / scheduler defaults from CacheConfig / SchedulerConfig (one source:
    the block size once had to be changed in three places)."""
    import inspect

    from tokenspout.config import CacheConfig, SchedulerConfig
    from tokenspout.engine.llm import build_engine_config

    cache, sched = CacheConfig(), SchedulerConfig()
    want = {"block_size": cache.block_size, "kv_cache_memory": cache.kv_cache_memory_gib,
            "max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens}
    got = kwargs()
    params = inspect.signature(build_engine_config).parameters
    for name, value in want.items():
        assert got[name] == value and params[name].default == value, name
    assert params["kv_cache_dtype"].default == cache.kv_cache_dtype


def test_batch_invariant_flag():
    """Off by default; --batch-invariant reaches the model config (the engine checks it can run: see
    tests/parity/test_batch_invariance.py); with int8 activations the config refuses it."""
    from tokenspout.engine.llm import build_engine_config

    assert kwargs()["batch_invariant"] is False
    assert kwargs("--batch-invariant")["batch_invariant"] is True
    cfg = build_engine_config(**{k: v for k, v in kwargs("--batch-invariant").items()
                                 if k in ("quantization", "batch_invariant")})
    assert cfg.model.batch_invariant is True
    with pytest.raises(ValueError, match="batch_invariant needs activation_quant int16"):
        build_engine_config(batch_invariant=True, activation_quant="int8")
