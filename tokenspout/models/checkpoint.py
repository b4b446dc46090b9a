"""A model's checkpoint, tensor by tensor: which checkpoint tensors make each parameter (`weight_plan`: Q/K/V and
gate/up are fused here), reading them from safetensors files (`CheckpointReader`) or a GGUF file
(models/gguf_model.GGUFCheckpoint) behind one interface (`open_checkpoint`), and copying them into parameters.
Every failure names the file or tensor at fault.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tokenspout.models.llama import LlamaArch, LlamaForCausalLM

logger = logging.getLogger(__name__)


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            data = json.loads(index.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{index} is corrupt: {e}") from e
        if not isinstance(data, dict) or "weight_map" not in data:
            raise ValueError(f"{index} is corrupt: it must be a JSON object with a weight_map")
        weight_map = data["weight_map"]
        # (a list, or a map to non-strings, failed as an AttributeError / TypeError naming nothing)
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) and f for f in weight_map.values()):
            raise ValueError(f"{index} is corrupt: weight_map must be an object mapping tensor names to files")
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


def checkpoint_dtype(path: Path) -> str | None:
    """The dtype most of a safetensors folder's 2-D tensors are stored in ("BF16", "F16", "F32", ...), read from the
    first file's header alone (no tensor is read); None when it cannot be told (no file, a GGUF, a bad header)."""
    import struct

    try:
        first = _safetensors_files(path)[0]
        with open(first, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 << 20:
                return None
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error, IndexError):
        return None
    kinds = [v.get("dtype") for k, v in header.items()
             if k != "__metadata__" and isinstance(v, dict) and len(v.get("shape", ())) == 2]
    return max(set(kinds), key=kinds.count) if kinds else None


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
        self._shapes: dict[str, tuple[int, ...]] = {}  # from the headers, read once (not a file open per tensor)
        for f in _safetensors_files(path):
            try:
                with safe_open(str(f), framework="pt") as sf:
                    for k in sf.keys():  # noqa: SIM118 - safe_open is not iterable
                        self.where[k.removeprefix("model.")] = (f, k)
                        self._shapes[k.removeprefix("model.")] = tuple(sf.get_slice(k).get_shape())
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

    def layer_count(self) -> int:
        """1 + the highest layer index among the tensors (layers.{i}.*)."""
        return 1 + max((int(k.split(".")[1]) for k in self.where if k.startswith("layers.")
                        and k.split(".")[1].isdigit()), default=-1)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.where:
            raise ValueError(f"weights are missing tensor {name!r}")
        return self._shapes[name]

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
