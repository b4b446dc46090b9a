"""Loads a local Hugging Face folder (safetensors, single or sharded) into the flat-batch model.

Never downloads: the folder must exist and hold config.json, tokenizer files and *.safetensors.  Q/K/V and gate/up
weights are concatenated here so the model runs one GEMM for each.  Every failure names the file or tensor at fault.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import SafetensorError, safe_open

from tokenspout.config import ModelConfig, read_hf_config
from tokenspout.models.default_model import resolve_model_path
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
    weights, and bench.paths measured every bfloat16 row slower than them: on an AVX512-BF16 EPYC the bfloat16
    torch path decoded the default model 3.5x slower than float32 + int4 kernels); bfloat16 only where the kernels
    are off and the CPU has native bf16 matrix instructions (torch's oneDNN bf16 GEMMs), float32 elsewhere."""
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


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is corrupt: {e}") from e
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{f} (named in {index.name}) is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path} (only safetensors are loaded)")
    return files


def open_checkpoint(path: Path):
    """The weights of a model folder, tensor by tensor: a CheckpointReader over its safetensors, or for a GGUF's
    sidecar folder a GGUFCheckpoint over the file (same `get` / `warn_unused`)."""
    from tokenspout.models.gguf_file import gguf_source

    src = gguf_source(path)
    if src is None:
        return CheckpointReader(path)
    from tokenspout.models.gguf_model import GGUFCheckpoint

    return GGUFCheckpoint(src)


def weight_files(path: Path) -> list[Path]:
    """The files a model's weights come from (the quantized-weights cache is keyed on them)."""
    from tokenspout.models.gguf_file import gguf_source

    src = gguf_source(path)
    return [src] if src is not None else _safetensors_files(path)


def read_state_dict(path: Path, arch: LlamaArch | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (for a GGUF sidecar: the tensors `arch` needs, dequantized to float32)."""
    from tokenspout.models.gguf_file import gguf_source

    if gguf_source(path) is not None:
        assert arch is not None
        reader = open_checkpoint(path)
        return {k: reader.get(k) for keys in weight_plan(arch).values() for k in keys}
    state: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(path):
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():  # noqa: SIM118 - safe_open is not iterable
                    state[k] = sf.get_tensor(k)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ValueError(f"cannot read weights file {f}: {e} (corrupt or truncated?)") from e
    return state


def _take(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return state.pop(name)
    except KeyError:
        raise ValueError(f"weights are missing tensor {name!r}") from None


def weight_plan(a: LlamaArch) -> dict[str, list[str]]:
    """Each model parameter -> the checkpoint tensors (names without the "model." prefix) it is made of, stacked
    along dim 0: Q/K/V and gate/up are fused here.  A tied LM head has no entry (it is the embedding)."""
    plan = {"embed_tokens.weight": ["embed_tokens.weight"], "norm.weight": ["norm.weight"]}
    if not a.tie_word_embeddings:
        plan["lm_head.weight"] = ["lm_head.weight"]
    for i in range(a.num_layers):
        p = f"layers.{i}."
        plan[p + "self_attn.qkv_proj.weight"] = [p + f"self_attn.{n}_proj.weight" for n in "qkv"]
        if a.qkv_bias:
            plan[p + "self_attn.qkv_proj.bias"] = [p + f"self_attn.{n}_proj.bias" for n in "qkv"]
        plan[p + "self_attn.o_proj.weight"] = [p + "self_attn.o_proj.weight"]
        if a.qk_norm:
            plan[p + "self_attn.q_norm.weight"] = [p + "self_attn.q_norm.weight"]
            plan[p + "self_attn.k_norm.weight"] = [p + "self_attn.k_norm.weight"]
        plan[p + "mlp.gate_up_proj.weight"] = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        plan[p + "mlp.down_proj.weight"] = [p + "mlp.down_proj.weight"]
        plan[p + "input_layernorm.weight"] = [p + "input_layernorm.weight"]
        plan[p + "post_attention_layernorm.weight"] = [p + "post_attention_layernorm.weight"]
    return plan


class CheckpointReader:
    """The folder's tensors read one at a time (names without the "model." prefix).  Each read maps its file only
    for that tensor: a mapping kept open holds every page it has read in the process's RSS, which for a whole
    checkpoint read through it is the whole checkpoint."""

    def __init__(self, path: Path):
        self.where: dict[str, tuple[Path, str]] = {}
        for f in _safetensors_files(path):
            try:
                with safe_open(str(f), framework="pt") as sf:
                    for k in sf.keys():  # noqa: SIM118 - safe_open is not iterable
                        self.where[k.removeprefix("model.")] = (f, k)
            except (SafetensorError, OSError, RuntimeError) as e:
                raise ValueError(f"cannot read weights file {f}: {e} (corrupt or truncated?)") from e

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise ValueError(f"weights are missing tensor {name!r}")
        f, k = self.where[name]
        try:
            with safe_open(str(f), framework="pt") as sf:
                return sf.get_tensor(k)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ValueError(f"cannot read tensor {k} of {f}: {e} (corrupt or truncated?)") from e

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.where:
            raise ValueError(f"weights are missing tensor {name!r}")
        f, k = self.where[name]
        with safe_open(str(f), framework="pt") as sf:
            return tuple(sf.get_slice(k).get_shape())

    def warn_unused(self, plan: dict[str, list[str]]) -> None:
        used = {k for keys in plan.values() for k in keys} | {"lm_head.weight"}
        leftover = [k for k in self.where if k not in used and "rotary_emb" not in k]
        if leftover:
            logger.warning("ignoring %d unexpected tensors, e.g. %s", len(leftover), leftover[:3])


def load_weights(model: LlamaForCausalLM, state: dict[str, torch.Tensor]) -> None:
    state = {k.removeprefix("model."): v for k, v in state.items()}
    plan = weight_plan(model.arch)
    params = {name: [_take(state, k) for k in keys] for name, keys in plan.items()}
    if model.arch.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    leftover = [k for k in state if "rotary_emb" not in k]
    if leftover:
        logger.warning("ignoring %d unexpected tensors, e.g. %s", len(leftover), leftover[:3])
    own = dict(model.named_parameters())
    for name, parts in params.items():
        copy_rows(own, name, parts)


def copy_rows(own: Mapping[str, torch.Tensor], name: str, parts: list[torch.Tensor]) -> None:
    """Copies the checkpoint tensors `parts` into parameter `name`, stacked along dim 0 (checked shapes)."""
    if name not in own:
        raise ValueError(f"internal: no parameter {name}")
    shape = (sum(t.shape[0] for t in parts), *parts[0].shape[1:])
    if own[name].shape != shape or any(t.shape[1:] != parts[0].shape[1:] for t in parts):
        got = " + ".join(str(tuple(t.shape)) for t in parts)
        raise ValueError(f"tensor {name} has shape {got}, expected {tuple(own[name].shape)}")
    # Copied straight into the parameter's rows (no torch.cat temporary: one pass over the weights, not two).
    row = 0
    with torch.no_grad():
        for t in parts:
            own[name][row : row + t.shape[0]].copy_(t)
            row += t.shape[0]


def load_model(cfg: ModelConfig) -> LoadedModel:
    path, name = resolve_model_path(cfg.model)
    hf = load_hf_config(path)
    arch = LlamaArch.from_hf(hf)
    dtype = resolve_dtype(cfg.dtype)
    max_len = cfg.max_model_len or arch.max_position_embeddings
    if max_len > arch.max_position_embeddings:
        logger.warning("max_model_len %d exceeds the model's %d positions", max_len, arch.max_position_embeddings)
    inv_freq, scaling = rope_inv_freq(hf, arch.head_dim)
    with torch.device("meta"):
        meta_model = model_class(arch.architecture)(arch)

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
            model.lm_head.weight = model.embed_tokens.weight
        load_weights(model, read_state_dict(path, arch))
        return finish(model)

    quantized = None
    if cfg.quantization is None:
        model = fresh()
    else:
        from tokenspout.kernels import cpu
        from tokenspout.models.quant_cache import load_or_quantize
        from tokenspout.models.quant_load import build_quantized
        from tokenspout.models.quantize import quantize_model

        method, lib = cfg.quantization, cpu.load()

        def build() -> tuple[LlamaForCausalLM, dict]:
            """Where the kernels run: linear layers that keep only their packed weights, quantized one at a time
            from the checkpoint (no float copy of the model, ever); elsewhere the float model, then quantized."""
            if lib is not None:
                return build_quantized(meta_model, path, method, dtype, lib, finish)
            m = fresh()
            return m, quantize_model(m, method)

        files = [*weight_files(path), path / "config.json"]
        model, quantized = load_or_quantize(meta_model, path, files, method, dtype, build, lib)
        if model.rotary is None:  # loaded from the cache
            model = finish(model)
    return LoadedModel(model=model, path=path, name=cfg.served_model_name or name, arch=arch,
                       hf_config=hf, max_model_len=max_len, dtype=dtype, quantized=quantized)
