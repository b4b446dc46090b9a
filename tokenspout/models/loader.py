"""Loads a local Hugging Face folder (safetensors, single or sharded) or a GGUF file's sidecar folder into the
flat-batch model.

Never downloads: the folder must exist and hold config.json, tokenizer files and *.safetensors (or name its GGUF
file).  Reading the weights is models/checkpoint.py's job; this module resolves the configuration and dtype, builds
the model and chooses the float or the quantized path.  Every failure names the file or tensor at fault.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from tokenspout.config import ModelConfig, read_hf_config
from tokenspout.models.checkpoint import load_weights, open_checkpoint, read_state_dict, weight_files, weight_plan
from tokenspout.models.default_model import resolve_model_path
from tokenspout.models.gguf_file import gguf_source
from tokenspout.models.llama import LlamaArch, LlamaForCausalLM, Rotary
from tokenspout.models.registry import model_class

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    path: Path
    name: str
    arch: LlamaArch
    hf_config: object  # config.json as attributes (SimpleNamespace) or a transformers PretrainedConfig
    max_model_len: int
    dtype: torch.dtype
    # packed codes for the kernels when ModelConfig.quantization is set (the model's linear layers are then
    # QuantLinear modules over them where the kernels run, else hold the dequantized weights)
    quantized: dict | None = None  # module name -> models.quantize.PackedWeight
    # load_model(defer_cache_write=True): the quantized-weights cache file still to write (quant_cache), or None
    write_cache: Callable[[], None] | None = None


def mark_act8(quantized: dict) -> None:
    """int8 activations (ModelConfig.activation_quant) for every quantized linear layer but the LM head, whose
    logits the sampler and logprobs read: it keeps int16.  A fused weight's tail shares its activations."""
    for name, pw in quantized.items():
        while name != "lm_head" and pw is not None:
            pw.act8, pw = True, pw.tail


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype == "float32":
        return torch.float32
    if dtype == "bfloat16":
        return torch.bfloat16
    if dtype == "auto":
        return torch.float32 if auto_prefers_float32() else torch.bfloat16
    raise ValueError(f"dtype must be 'float32', 'bfloat16' or 'auto', got {dtype!r}")


def auto_prefers_float32() -> bool:
    """`--dtype auto`: float32 wherever the C kernels load (they run float32 activations over float32 or quantized
    weights; bench.paths on an AVX512-BF16 EPYC: with quantized weights every bfloat16 row 5-6x slower at one
    client); bfloat16 only where the kernels are off and the CPU has native bf16 matrix instructions (torch's oneDNN
    bf16 GEMMs), float32 elsewhere."""
    from tokenspout.kernels import cpu
    from tokenspout.platform import has_native_bf16

    return cpu.load() is not None or not has_native_bf16()


# Fields the model reads from the config; transformers' defaults for them differ between architectures, so the
# config is read without transformers only when it spells them all out.
_REQUIRED_FIELDS = ("architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "max_position_embeddings",
                    "tie_word_embeddings")


def plain_hf_config(cfg: dict) -> SimpleNamespace | None:
    """config.json as attributes when it spells out every field the model reads and uses plain (default) RoPE;
    None when transformers must fill in a default or convert RoPE parameters.

    Why: AutoConfig imports transformers' model machinery (accelerate, torch.distributed, sympy: ~2 s of CPU at
    every engine start) to read a JSON file.  tests/unit/test_startup.py checks both give the same architecture
    and RoPE tables."""
    if any(cfg.get(k) is None for k in _REQUIRED_FIELDS):
        return None
    if cfg.get("head_dim") is None and "Qwen3ForCausalLM" in (cfg.get("architectures") or []):
        return None  # Qwen3's default head_dim is 128, not hidden_size / num_heads
    rope = cfg.get("rope_parameters") or {}
    if cfg.get("rope_scaling") or cfg.get("partial_rotary_factor") not in (None, 1, 1.0):
        return None
    if rope.get("rope_type", rope.get("type", "default")) != "default" or set(rope) - {"rope_type", "type",
                                                                                       "rope_theta"}:
        return None
    if rope.get("rope_theta") is None and cfg.get("rope_theta") is None:
        return None
    return SimpleNamespace(**cfg)


def load_hf_config(path: Path):
    cfg = read_hf_config(path)  # clear errors for missing folder / file / unsupported architecture first
    plain = plain_hf_config(cfg)
    if plain is not None:
        return plain
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def rope_inv_freq(hf, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling, computed by transformers' own RoPE functions (parity)."""
    params = getattr(hf, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)), 1.0
    if rope_type not in ("linear", "llama3", "dynamic", "yarn"):
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported (default, linear, llama3, yarn)")
    if rope_type == "dynamic":
        logger.warning("dynamic RoPE scaling is applied statically (as at the original context length)")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # imported only here: ~2 s of CPU

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
    return inv_freq, float(scaling)


# Positions served at most: the rotary tables hold every position (a file claiming 2^31 asked for 64 GiB of them).
# 2^20 is past any context a CPU serves (its tables: 512 MiB at head_dim 128).
MAX_POSITIONS = 1 << 20


def context_length(asked: int | None, model_positions: int) -> int:
    """--max-model-len, else the model's own positions (at most MAX_POSITIONS)."""
    if asked is not None and asked > MAX_POSITIONS:
        raise ValueError(f"max_model_len {asked} is above what tokenspout serves ({MAX_POSITIONS} positions)")
    if asked is None and model_positions > MAX_POSITIONS:
        logger.warning("the model claims %d positions; serving %d (--max-model-len chooses)", model_positions,
                       MAX_POSITIONS)
        return MAX_POSITIONS
    max_len = asked or model_positions
    if max_len > model_positions:
        logger.warning("max_model_len %d exceeds the model's %d positions", max_len, model_positions)
    return max_len


def check_layers(arch: LlamaArch, checkpoint: Any, path: Path) -> None:
    """The config's layer count against the weights, before a model of that many layers is built (a crafted
    file's block_count of 200,000 built layers for minutes, growing past 3 GB, before a tensor was missed)."""
    held = checkpoint.layer_count()
    if held < arch.num_layers:
        source = gguf_source(path) or path
        raise ValueError(f"{source.name}: the config has {arch.num_layers} layers (num_hidden_layers / block_count) "
                         f"but the weights hold {held}")


def check_shapes(meta_model: torch.nn.Module, arch: LlamaArch, checkpoint: Any) -> None:
    """Every tensor the model is made of has the shape its parameter needs (fused parts: their rows add up), from
    the checkpoint's tensor table, before any is read: the quantized path reads the embedding by itself, and an
    embedding narrower than the config there corrupted the kernels' heap."""
    params = dict(meta_model.named_parameters())
    for pname, names in weight_plan(arch).items():
        want = tuple(params[pname].shape)
        shapes = [checkpoint.shape(n) for n in names]
        rows = sum(s[0] for s in shapes if s)
        if any(len(s) != len(want) or s[1:] != want[1:] for s in shapes) or rows != want[0]:
            if len(names) == 1:
                raise ValueError(f"weights: tensor {names[0]} has shape {shapes[0]}, the config needs {want}")
            got = ", ".join(f"{n} {s}" for n, s in zip(names, shapes))
            raise ValueError(f"weights: {got} do not add up to the {want} the config needs for {pname}")


def load_model(cfg: ModelConfig, defer_cache_write: bool = False) -> LoadedModel:
    """defer_cache_write: a first start's quantized-weights cache file is left to LoadedModel.write_cache (the
    engine process writes it once it is ready) instead of being written before this returns."""
    cfg.validate()  # (callers that build a ModelConfig by hand: quantization="none" went down the quantized path)
    path, name = resolve_model_path(cfg.model)
    hf = load_hf_config(path)
    arch = LlamaArch.from_hf(hf)
    dtype = resolve_dtype(cfg.dtype)
    max_len = context_length(cfg.max_model_len, arch.max_position_embeddings)
    checkpoint = open_checkpoint(path)
    check_layers(arch, checkpoint, path)
    inv_freq, scaling = rope_inv_freq(hf, arch.head_dim)
    factors = checkpoint.rope_freq_factors(arch.head_dim) if hasattr(checkpoint, "rope_freq_factors") else None
    if factors is not None:  # a GGUF file's llama3 scaling, as llama.cpp applies it
        inv_freq = inv_freq / factors
    with torch.device("meta"):
        meta_model = model_class(arch.architecture)(arch)
    check_shapes(meta_model, arch, checkpoint)

    def finish(model: LlamaForCausalLM) -> LlamaForCausalLM:
        # The rotary tables are built on the CPU (to_empty / a meta model leave none) and follow the model dtype.
        model.rotary = Rotary(inv_freq, scaling, max_len)
        model = model.to(dtype).eval()
        model.requires_grad_(False)
        return model

    def fresh() -> LlamaForCausalLM:
        """The model with the folder's weights, in `dtype`."""
        model = meta_model.to_empty(device="cpu")
        if arch.tie_word_embeddings:  # to_empty untied the embeddings: retie them
            assert isinstance(model.embed_tokens, torch.nn.Embedding)  # (a float model's)
            model.lm_head.weight = model.embed_tokens.weight
        load_weights(model, read_state_dict(path, arch))
        return finish(model)

    quantized, write_cache = None, None
    if cfg.quantization is None:
        model = fresh()
        if cfg.activation_quant == "int8":
            logger.info("--activation-quant int8 applies to int4 / int8 weights only: float weights here")
    else:
        from tokenspout.kernels import cpu
        from tokenspout.models.quant_cache import load_or_quantize
        from tokenspout.models.quant_load import build_quantized
        from tokenspout.models.quantize import HALF_FORMATS, quantize_model

        method, lib = cfg.quantization, cpu.load()
        src = gguf_source(path)
        if lib is not None and src is not None:  # the embedding's rows stay in the file, dequantized per lookup
            from tokenspout.models.gguf_model import GGUFEmbedding

            meta_model.embed_tokens = GGUFEmbedding(src, dtype)
        if method in HALF_FORMATS and lib is None:
            # 16-bit weights only pay through the kernels; without them the float model computes with the same
            # values (a bf16 / fp16 checkpoint's weights are exact in float32)
            logger.info("--quantization %s needs the C kernels (off here): float weights", method)
            return load_model(dataclasses.replace(cfg, quantization=None), defer_cache_write)

        def build() -> tuple[LlamaForCausalLM, dict]:
            """Where the kernels run: linear layers that keep only their packed weights, quantized one at a time
            from the checkpoint (no float copy of the model, ever); elsewhere the float model, then quantized."""
            if lib is not None:
                return build_quantized(meta_model, path, method, dtype, lib, finish)
            m = fresh()
            return m, quantize_model(m, method)

        files = [*weight_files(path), path / "config.json"]
        model, quantized, write_cache = load_or_quantize(meta_model, path, files, method, dtype, build, lib,
                                                         defer_write=defer_cache_write)
        if model.rotary is None:  # loaded from the cache
            model = finish(model)
        if cfg.activation_quant == "int8" and lib is not None:
            mark_act8(quantized)
        elif cfg.activation_quant == "int8":
            logger.info("--activation-quant int8 needs the C kernels (off here): int16-level results")
    return LoadedModel(model=model, path=path, name=cfg.served_model_name or name, arch=arch,
                       hf_config=hf, max_model_len=max_len, dtype=dtype, quantized=quantized, write_cache=write_cache)
