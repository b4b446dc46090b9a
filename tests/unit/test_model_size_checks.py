"""A model file whose config and tensors disagree is refused before a model is built from it (audit, session 30):
an embedding narrower than the config (which corrupted the kernels' heap on the quantized path), a layer count far
past the tensors (minutes and gigabytes of layers built first), key / value heads that do not divide the query
heads (silent garbage), a tensor type nothing reads, a 0-dimensional norm; a context length of 2^31 is capped
(its rotary tables asked for 64 GiB); a chat template that never ends is stopped.  The files are tiny llama GGUFs
(2 layers, hidden 64) with the byte-level vocabulary of test_model_file_errors.py."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFValueType as V

from tests.unit.test_model_file_errors import HPARAMS, TOKENIZER, TOKENS
from tokenspout.config import ModelConfig
from tokenspout.engine.chat_template import TemplateTimeout, run_with_time_limit
from tokenspout.models.loader import MAX_POSITIONS, load_model

H, I, HEADS, KV = 64, 128, 4, 2


def build(path: Path, hparams: dict | None = None, tensors: dict | None = None) -> Path:
    """A complete tiny llama GGUF (every layer tensor); `tensors`: arrays replacing (or None dropping) some."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    for name, kv in {**HPARAMS, **(hparams or {})}.items():
        if kv is not None:
            w.add_key_value(f"llama.{name}", kv[0], kv[1])
    for key, kv in TOKENIZER.items():
        w.add_key_value(key, kv[0], kv[1], sub_type=kv[2] if len(kv) > 2 else None)
    g = np.random.default_rng(0)

    def r(*shape: int) -> np.ndarray:
        return (g.standard_normal(shape) * 0.05).astype(np.float32)

    d = H // HEADS
    arrays: dict[str, np.ndarray] = {"token_embd.weight": r(len(TOKENS), H), "output_norm.weight": np.ones(H, np.float32)}
    for i in range(2):
        arrays |= {f"blk.{i}.attn_q.weight": r(HEADS * d, H), f"blk.{i}.attn_k.weight": r(KV * d, H),
                   f"blk.{i}.attn_v.weight": r(KV * d, H), f"blk.{i}.attn_output.weight": r(H, HEADS * d),
                   f"blk.{i}.ffn_gate.weight": r(I, H), f"blk.{i}.ffn_up.weight": r(I, H),
                   f"blk.{i}.ffn_down.weight": r(H, I), f"blk.{i}.attn_norm.weight": np.ones(H, np.float32),
                   f"blk.{i}.ffn_norm.weight": np.ones(H, np.float32)}
    for name, a in {**arrays, **(tensors or {})}.items():
        if a is None:
            continue
        if isinstance(a, tuple):  # (array, raw GGML type): the bytes as they are, in that type
            w.add_tensor(name, a[0], raw_dtype=a[1])
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENSPOUT_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_a_well_formed_file_loads(tmp_path: Path, quantization):
    m = load_model(ModelConfig(model=str(build(tmp_path / "ok.gguf")), quantization=quantization))
    assert m.max_model_len == 256


@pytest.mark.parametrize("quantization", [None, "int8"])
@pytest.mark.parametrize(("hparams", "tensors", "says"), [
    (None, {"token_embd.weight": np.zeros((len(TOKENS), 32), np.float32)},
     r"tensor embed_tokens.weight has shape \(259, 32\), the config needs \(259, 64\)"),
    (None, {"token_embd.weight": np.zeros((100, H), np.float32)}, r"embed_tokens.weight has shape \(100, 64\)"),
    (None, {"blk.1.ffn_down.weight": np.zeros((H, 64), np.float32)}, r"layers.1.mlp.down_proj.weight has shape"),
    (None, {"blk.0.attn_k.weight": np.zeros((8, H), np.float32)}, r"do not add up to the \(128, 64\)"),
    (None, {"output_norm.weight": np.array(1.0, np.float32)}, r"tensor norm.weight has shape \(\), the config"),
    ({"block_count": (200_000, V.UINT32)}, None, r"the config has 200000 layers .* but the weights hold 2"),
    ({"attention.head_count_kv": (3, V.UINT32)}, None,
     r"num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    (None, {"blk.0.attn_q.weight": (np.zeros((H, H), np.float64).view(np.uint8), GGMLQuantizationType.F64)},
     r"unsupported GGUF tensor type F64 for tensor blk.0.attn_q.weight"),
])
def test_config_and_tensors_that_disagree_are_refused_first(tmp_path: Path, quantization, hparams, tensors, says):
    path = build(tmp_path / "bad.gguf", hparams, tensors)
    t = time.perf_counter()
    with pytest.raises(ValueError, match=says):
        load_model(ModelConfig(model=str(path), quantization=quantization))
    assert time.perf_counter() - t < 30  # (200,000 layers were built for minutes before)


def test_a_huge_context_length_is_capped(tmp_path: Path):
    path = build(tmp_path / "long.gguf", {"context_length": (1 << 31, V.UINT32)})
    assert load_model(ModelConfig(model=str(path))).max_model_len == MAX_POSITIONS
    with pytest.raises(ValueError, match="max_model_len 2097152 is above"):
        load_model(ModelConfig(model=str(path), max_model_len=1 << 21))


def test_a_chat_template_that_never_ends_is_stopped():
    from jinja2 import Template

    loop = Template("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    t = time.perf_counter()
    with pytest.raises(TemplateTimeout, match="ran longer than 0.3 s"):
        run_with_time_limit(loop.render, 0.3)
    assert time.perf_counter() - t < 5
    assert run_with_time_limit(lambda: Template("{{ 1 + 1 }}").render(), 0.3) == "2"  # a quick one is untouched


def test_a_cache_file_damaged_at_its_full_size_is_rebuilt(tmp_path: Path):
    """Zeroed data in the quantized-weights cache (a crash before its pages reached the disk) had loaded silently
    and generated zeros ever after: the sampled digest written with the file finds it, and the file is rebuilt."""
    path = build(tmp_path / "c.gguf")
    first = load_model(ModelConfig(model=str(path), quantization="int8"))  # quantizes, writes the cache file
    files = sorted((Path(os.environ["TOKENSPOUT_CACHE"]) / "quantized").rglob("c-*.safetensors"))
    assert len(files) == 1, files
    size = files[0].stat().st_size
    with open(files[0], "r+b") as fh:  # zero the second half (data), keeping the size
        fh.seek(size // 2)
        fh.write(b"\0" * (size - size // 2))
    again = load_model(ModelConfig(model=str(path), quantization="int8"))
    assert first.quantized and again.quantized
    for name, pw in first.quantized.items():
        assert torch.equal(again.quantized[name].codes, pw.codes), name
