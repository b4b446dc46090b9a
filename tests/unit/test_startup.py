"""Start-up shortcuts give exactly what the slow paths give: the quantized-weights cache (bit-identical weights and
packed codes; corrupt files rebuilt; keys that change with what the values depend on), config.json read without
transformers, the tokenizer loaded without AutoTokenizer, lazily zeroed KV caches, and a frontend that never
imports torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenspout.kernels import cpu
from tokenspout.config import ModelConfig
from tokenspout.models import quant_cache
from tokenspout.models.llama import LlamaArch
from tokenspout.models.loader import load_hf_config, load_model, plain_hf_config, rope_inv_freq
from tokenspout.models.quant_linear import QuantLinear
from tokenspout.models.quantize import PackedWeight

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty TOKENSPOUT_CACHE; returns its quantized/ folder."""
    monkeypatch.setenv("TOKENSPOUT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "quantized"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny Llama with tied embeddings (quantization unties the LM head) saved as a Hugging Face folder."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def _load(path: Path, method: str, dtype: str = "float32"):
    return load_model(ModelConfig(model=str(path), quantization=method, dtype=dtype))


def _assert_same_packed(name: str, pa: PackedWeight, pb: PackedWeight) -> None:
    assert (pa.n, pa.k, pa.wt) == (pb.n, pb.k, pb.wt), name
    for f in ("codes", "scale", "min"):
        ta, tb = getattr(pa, f), getattr(pb, f)
        assert (ta is None) == (tb is None), (name, f)
        if ta is not None:
            assert ta.dtype == tb.dtype and torch.equal(ta, tb), (name, f)
    assert (pa.tail is None) == (pb.tail is None), name
    if pa.tail is not None and pb.tail is not None:
        _assert_same_packed(name + ".tail", pa.tail, pb.tail)


def _assert_identical(a, b) -> None:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    assert a.quantized.keys() == b.quantized.keys()
    for name, pa in a.quantized.items():
        _assert_same_packed(name, pa, b.quantized[name])
    for m in (a.model, b.model):  # the head is untied, like quantize_model leaves it: where the kernels run a
        # QuantLinear holding only its packed weight (no float copy anywhere in the model), else dequantized floats
        if cpu.load() is not None:
            assert isinstance(m.lm_head, QuantLinear) and not any(
                k.endswith("proj.weight") or k == "lm_head.weight" for k in m.state_dict())
        else:
            assert m.lm_head.weight is not m.embed_tokens.weight
    assert torch.equal(a.model.rotary.cos, b.model.rotary.cos)


def _cache_files(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.safetensors"))


def _no_quantizing(monkeypatch) -> None:
    def fail(*_a, **_k):
        raise AssertionError("quantized again despite a valid cache")

    from tokenspout.models import quant_load, quantize

    monkeypatch.setattr(quant_load, "build_quantized", fail)  # where the kernels run
    monkeypatch.setattr(quantize, "quantize_model", fail)  # elsewhere


@pytest.mark.parametrize(("method", "dtype"), [("int4", "float32"), ("int8", "float32"), ("int4", "bfloat16")])
def test_cached_load_is_bit_identical(tiny_model, cache, method, dtype, monkeypatch):
    fresh = _load(tiny_model, method, dtype)  # quantizes and writes the cache
    assert len(_cache_files(cache)) == 1
    _no_quantizing(monkeypatch)
    cached = _load(tiny_model, method, dtype)
    _assert_identical(fresh, cached)
    # The parameters are the mapped file's tensors, each 64-byte aligned (the torch path reads them faster).
    ptrs = [t.data_ptr() for t in cached.model.state_dict().values()]
    ptrs += [t.data_ptr() for pw in cached.quantized.values() for t in (pw.codes, pw.scale, pw.min) if t is not None]
    assert all(p % 64 == 0 for p in ptrs)


def test_deferred_cache_write(tiny_model, cache, monkeypatch):
    """A server's first start (load_model(defer_cache_write=True)) returns before the cache file is written: the
    write is LoadedModel.write_cache, which the engine runs once it is ready; a temporary file a killed writer left
    is removed by it; the next start maps the file (nothing left to write) with the same weights."""
    cfg = ModelConfig(model=str(tiny_model), quantization="int4")
    fresh = load_model(cfg, defer_cache_write=True)
    assert fresh.write_cache is not None and _cache_files(cache) == []
    prefix = next(cache.glob(".*lock")).name.removeprefix(".").removesuffix("lock")
    stale = cache / f".{prefix}{'0' * 16}.safetensors.4242.tmp"
    stale.write_bytes(b"half a file")
    fresh.write_cache()
    assert len(_cache_files(cache)) == 1 and not stale.exists()
    _no_quantizing(monkeypatch)
    cached = load_model(cfg, defer_cache_write=True)
    assert cached.write_cache is None
    _assert_identical(fresh, cached)


def _int6(w: torch.Tensor):
    """w [N, 64] as an int6 weight (K = 64: the first pair of groups of a Q6_K fit of w padded to 256 columns)."""
    from bench.common import q6k_int6

    n = w.shape[0]
    wide, _, _ = q6k_int6(torch.cat([w, w.new_zeros(n, 192)], 1), cpu.load())
    nb = -(-n // 4)
    return PackedWeight(wide.codes.view(nb, 4, 208)[:, :1].reshape(-1), wide.scale.view(nb, 8, 4)[:, :2].reshape(-1),
                        None, n, 64, cpu.WT_Q6)


@pytest.mark.skipif(cpu.load() is None, reason="a weight of two formats exists only where the kernels run")
@pytest.mark.parametrize("tail_fmt", ["int8", "int6"])
def test_weight_of_two_formats_round_trips_the_cache(tiny_model, cache, monkeypatch, tail_fmt):
    """A fused weight of two formats (int4 rows, then an int8 or int6 tail: a GGUF file's Q4_K q / k and Q6_K v,
    without and with the kernels' int6) is cached and mapped back as it was, and computes the same as its
    dequantized values."""
    from tokenspout.models import quant_load
    from tokenspout.models.quantize import dequantize, quantize_int4, quantize_int8

    build = quant_load.build_quantized

    def two_formats(*args, **kwargs):
        model, packed = build(*args, **kwargs)
        for name, pw in packed.items():
            if name.endswith("qkv_proj"):
                w = dequantize(pw)
                head = quantize_int4(w[:64])[0]
                tail = quantize_int8(w[64:])[0] if tail_fmt == "int8" else _int6(w[64:])
                head.tail, head.n = tail, head.n + tail.n
                packed[name] = model.get_submodule(name).packed = head
        return model, packed

    monkeypatch.setattr(quant_load, "build_quantized", two_formats)
    fresh = _load(tiny_model, "int4")
    pw = fresh.quantized["layers.0.self_attn.qkv_proj"]
    assert pw.tail is not None and (pw.n, pw.tail.n, pw.tail.wt) == (128, 64, getattr(cpu, "WT_Q" + tail_fmt[3:]))
    _no_quantizing(monkeypatch)
    cached = _load(tiny_model, "int4")
    _assert_identical(fresh, cached)
    x = torch.randn(3, 64)
    qkv = cached.model.get_submodule("layers.0.self_attn.qkv_proj")
    torch.testing.assert_close(qkv(x), x @ dequantize(pw).T, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8])
def test_aligned_writer_round_trips(tmp_path, dtype):
    from safetensors import safe_open

    gen = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": (torch.randn(*shape, generator=gen) * 50).to(dtype)
               for i, shape in enumerate([(3,), (5, 7), (1,), (64, 3), (0,)])}
    quant_cache.write_aligned(tmp_path / "x.safetensors", tensors, {"k": "v"})
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert f.metadata() == {"k": "v"}
        for name, t in tensors.items():
            got = f.get_tensor(name)
            assert got.dtype == dtype and got.shape == t.shape and torch.equal(got, t)
            assert got.numel() == 0 or got.data_ptr() % 64 == 0


def test_truncated_cache_is_rebuilt(tiny_model, cache, monkeypatch):
    fresh = _load(tiny_model, "int4")
    (f,) = _cache_files(cache)
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size // 2)
    rebuilt = _load(tiny_model, "int4")
    _assert_identical(fresh, rebuilt)
    assert _cache_files(cache) == [f] and f.stat().st_size == size
    _no_quantizing(monkeypatch)
    _assert_identical(fresh, _load(tiny_model, "int4"))


@pytest.mark.parametrize("garbage", [b"", b"not a safetensors file", b"\xff" * 64])
def test_garbage_cache_is_rebuilt(tiny_model, cache, garbage):
    fresh = _load(tiny_model, "int4")
    (f,) = _cache_files(cache)
    f.write_bytes(garbage)
    _assert_identical(fresh, _load(tiny_model, "int4"))
    assert f.stat().st_size > 1000


def test_foreign_cache_file_is_rebuilt(tiny_model, cache):
    """A complete, readable file written for another key (here: the int8 file under the int4 name) is not used."""
    fresh4 = _load(tiny_model, "int4")
    (f4,) = _cache_files(cache)
    _load(tiny_model, "int8")
    (f8,) = [f for f in _cache_files(cache) if f != f4]
    f4.write_bytes(f8.read_bytes())
    _assert_identical(fresh4, _load(tiny_model, "int4"))


def test_cache_key_changes_with_what_the_values_depend_on(tiny_model, cache):
    files = [tiny_model / "model.safetensors", tiny_model / "config.json"]
    base = quant_cache.cache_key(files, "int4", torch.float32)
    names = {quant_cache.cache_file(tiny_model, base).name}
    for key in (quant_cache.cache_key(files, "int8", torch.float32),
                quant_cache.cache_key(files, "int4", torch.bfloat16)):
        assert key != base
        names.add(quant_cache.cache_file(tiny_model, key).name)
    st = files[0].stat()
    os.utime(files[0], ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # the weights were rewritten
    try:
        touched = quant_cache.cache_key(files, "int4", torch.float32)
        assert touched != base
        names.add(quant_cache.cache_file(tiny_model, touched).name)
    finally:
        os.utime(files[0], ns=(st.st_atime_ns, st.st_mtime_ns))
    assert len(names) == 4
    assert quant_cache.cache_key(files, "int4", torch.float32) == base  # and is stable otherwise


def test_stale_cache_files_are_pruned(tiny_model, cache):
    _load(tiny_model, "int4")
    (old,) = _cache_files(cache)
    stale = old.with_name(old.name[: old.name.rindex("-") + 1] + "0" * 16 + ".safetensors")
    old.rename(stale)
    _load(tiny_model, "int4")
    assert _cache_files(cache) == [old]


def test_cache_of_a_gone_or_changed_model_is_pruned(tiny_model, cache, tmp_path):
    """A model folder deleted (or its weights rewritten) since its cache file was made: the next cache file written,
    of any model, removes that file; the `under` form (the test suite's clean-up) removes a living folder's too."""
    import shutil

    gone, changed = tmp_path / "gone", tmp_path / "changed"
    for d in (gone, changed):
        shutil.copytree(tiny_model, d)
        _load(d, "int8")
    files = {f.name.split("-")[0]: f for f in _cache_files(cache)}
    assert files.keys() == {"gone", "changed"}
    shutil.rmtree(gone)
    weights = next(changed.glob("*.safetensors"))
    os.utime(weights, ns=(0, weights.stat().st_mtime_ns + 1))
    _load(tiny_model, "int4")  # another model's write prunes both
    assert [f.name.split("-")[0] for f in _cache_files(cache)] == ["tiny0"]
    assert quant_cache.prune(under=tmp_path) == []  # tiny0 lies elsewhere: kept
    (kept,) = _cache_files(cache)
    assert quant_cache.prune(under=tiny_model.parent) == [kept] and _cache_files(cache) == []


def test_unwritable_cache_still_loads(tiny_model, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("TOKENSPOUT_CACHE", str(blocker))
    lm = _load(tiny_model, "int4")
    assert lm.quantized and lm.model.rotary is not None


# ---- config.json without transformers -------------------------------------------------------------------------
def _tiny_configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
              "rms_norm_eps": 1e-6}
    cfgs = {"llama": LlamaConfig(**common, tie_word_embeddings=True, rope_theta=50000.0),
            "qwen2": Qwen2Config(**common, tie_word_embeddings=False),
            "qwen3": Qwen3Config(**common, head_dim=32),
            "mistral": MistralConfig(**common, sliding_window=None),
            "llama3-rope": LlamaConfig(**common, rope_scaling={
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64})}
    for cfg in cfgs.values():  # as a saved model writes it
        cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    return cfgs


@pytest.mark.parametrize("name", list(_tiny_configs()))
def test_plain_config_matches_autoconfig(name, tmp_path):
    from transformers import AutoConfig

    _tiny_configs()[name].save_pretrained(tmp_path)
    ref = AutoConfig.from_pretrained(str(tmp_path), local_files_only=True)
    plain = plain_hf_config(json.loads((tmp_path / "config.json").read_text()))
    if name == "llama3-rope":
        assert plain is None  # scaled RoPE: transformers computes it
        return
    assert plain is not None
    arch = LlamaArch.from_hf(plain)
    assert arch == LlamaArch.from_hf(ref)
    (f1, s1), (f2, s2) = rope_inv_freq(plain, arch.head_dim), rope_inv_freq(ref, arch.head_dim)
    assert torch.equal(f1, f2) and s1 == s2


def test_plain_config_needs_every_field(tmp_path):
    cfg = _tiny_configs()["qwen3"].to_dict()
    assert plain_hf_config(cfg) is not None
    assert plain_hf_config({k: v for k, v in cfg.items() if k != "head_dim"}) is None  # Qwen3's default is 128
    assert plain_hf_config({k: v for k, v in cfg.items() if k != "tie_word_embeddings"}) is None
    assert plain_hf_config({**cfg, "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                       "rope_theta": 1e4}}) is None


def test_default_model_config_is_plain(model_path):
    assert not hasattr(load_hf_config(model_path), "to_dict")  # the fast path, not a transformers config


# ---- tokenizer without AutoTokenizer --------------------------------------------------------------------------
def test_tokenizer_fast_path_matches_autotokenizer(model_path):
    from transformers import AutoTokenizer

    from tokenspout.engine.tokenizer import _generic_tokenizer_class, load_tokenizer

    assert _generic_tokenizer_class(model_path) is not None
    ours = load_tokenizer(model_path)
    ref = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    assert type(ours) is type(ref)
    assert ours.init_kwargs == ref.init_kwargs
    assert ours.all_special_ids == ref.all_special_ids and ours.get_vocab() == ref.get_vocab()
    msgs = [{"role": "user", "content": "Héllo <|im_end|> wörld 日本 🙂"}]
    text = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == text
    assert ours(text).input_ids == ref(text).input_ids
    ids = list(range(0, 2000, 7))
    assert ours.decode(ids) == ref.decode(ids)


def test_tokenizer_of_other_models_uses_autotokenizer(tmp_path):
    from tokenspout.engine.tokenizer import _generic_tokenizer_class

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend"}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))  # AutoTokenizer overrides qwen2's
    assert _generic_tokenizer_class(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert _generic_tokenizer_class(tmp_path) == "TokenizersBackend"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend",
                                                                "auto_map": {"AutoTokenizer": ["x.Y", None]}}))
    assert _generic_tokenizer_class(tmp_path) is None


# ---- KV cache, frontend imports -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeroed_kv_caches(dtype):
    from tokenspout.worker.model_runner import zeroed_kv_caches

    caches = zeroed_kv_caches(3, 40, 2, 8, dtype)
    assert len(caches) == 3 and len({c.data_ptr() for c in caches}) == 3
    for c in caches:
        assert c.shape == (2, 40, 2, 8) and c.dtype == dtype and c.is_contiguous()
        assert not c.any()
    caches[0][1, 7] = 1.5
    assert caches[0].sum().item() == 1.5 * 16 and not caches[1].any()


def test_frontend_does_not_import_torch(model_path):
    """The API server process imports the web stack and loads the tokenizer; torch (~1.5 s) is the engine's."""
    code = ("import sys\n"
            "from tokenspout.entrypoints.cli import main\n"
            "from tokenspout.engine.async_llm import AsyncLLM\n"
            "from tokenspout.engine.llm import build_engine_config\n"
            "from tokenspout.entrypoints.openai.api_server import build_app\n"
            "from tokenspout.engine.tokenizer import load_tokenizer\n"
            "load_tokenizer(build_engine_config(None).model.model)\n"
            "print(sorted(m for m in ('torch', 'transformers.configuration_utils') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.skipif(cpu.load() is None, reason="int5 weights need the C kernels")
def test_int5_weights_survive_the_cache(tiny_model, cache, monkeypatch):
    """int5 weights (what a GGUF file's Q5_* tensors become) written to the quantized-weights cache and mapped back:
    the same bytes, and the same outputs from the cached layers as from the fresh ones."""
    from tests.helpers import quantize_int5
    from tokenspout.models import quant_load

    lib = cpu.load()

    def int5(fmt: str, lib_=None):
        def fit(w: torch.Tensor):
            return quantize_int5(w, lib)[0], None

        return fit if fmt == "int4" else quantizer_before(fmt, lib_)

    quantizer_before = quant_load.quantizer
    monkeypatch.setattr(quant_load, "quantizer", int5)
    fresh = _load(tiny_model, "int4")
    assert fresh.quantized["layers.0.mlp.down_proj"].wt == cpu.WT_Q5
    assert fresh.quantized["lm_head"].wt == cpu.WT_Q8  # (int4 keeps the LM head int8)
    monkeypatch.setattr(quant_load, "quantizer", quantizer_before)
    _no_quantizing(monkeypatch)
    cached = _load(tiny_model, "int4")
    _assert_identical(fresh, cached)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(0))
    a = fresh.model.get_submodule("layers.1.mlp.down_proj")(x)
    b = cached.model.get_submodule("layers.1.mlp.down_proj")(x)
    assert torch.equal(a, b)
