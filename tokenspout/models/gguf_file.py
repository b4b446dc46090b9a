"""GGUF files, the part without torch (the API server imports it): recognising a GGUF path, its architecture, and
the sidecar folder (config.json, tokenizer files, chat template, generation config, gguf_source.json) that stands
for the file everywhere a model folder is expected.  The weights are read by models/gguf_model.py.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from tokenspout.models.cache_dir import cache_dir, folder_written_whole

logger = logging.getLogger(__name__)

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
SOURCE_FILE = "gguf_source.json"
_FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS")


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf"


def gguf_source(folder: Path) -> Path | None:
    """The GGUF file a sidecar folder stands for (None: an ordinary model folder)."""
    marker = folder / SOURCE_FILE
    return Path(json.loads(marker.read_text())["gguf"]) if marker.is_file() else None


def open_reader(gguf: Path, raw: bool = False):
    """The header of `gguf` (models/gguf_header.py: metadata scalars, tensors as views of the memory-mapped file;
    raw: every field as transformers reads it too), or a ValueError naming the file when it is not a GGUF file,
    truncated or corrupt."""
    from tokenspout.models.gguf_header import GGUFHeader

    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file {gguf} does not exist")
    try:
        return GGUFHeader(gguf, raw=raw)
    except Exception as e:  # noqa: BLE001 - ValueError from the checks, numpy's on a map of an empty file, ...
        raise ValueError(f"cannot read GGUF file {gguf}: {type(e).__name__}: {e} (not a GGUF file, or truncated "
                         "or corrupt?)") from None


def field(reader, key: str):
    """A metadata value (a numeric array's first item, as the gguf package's fields read)."""
    v = reader.fields.get(key)
    return v[0] if isinstance(v, list) and v else v


def architecture(reader) -> str:
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    return arch


def sidecar_folder(gguf: Path) -> Path:
    """The folder (config, tokenizer, template) of a GGUF file, written once per file (path, size, mtime)."""
    gguf = gguf.expanduser().resolve()
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file {gguf} does not exist")
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_dir() / "gguf" / f"{gguf.stem}-{key}"
    if (target / SOURCE_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / SOURCE_FILE).is_file():
            _write_sidecar(gguf, target)
    return target


@dataclass(frozen=True)
class _Field:
    """One metadata value as the gguf package's ReaderField presents it to transformers (`parts[i]` for i in `data`:
    one part per item, `types`: the value type, then an array's item type)."""

    name: str
    types: list[int]
    parts: list
    data: list[int]


class _TransformersReader:
    """What transformers' GGUF conversion (load_gguf_checkpoint: the config and tokenizer of a GGUF file) reads of
    the gguf package's GGUFReader, built from tokenspout's own header parser (`header`: a GGUFHeader read with
    raw=True): every metadata field with its parts, and the tensors (it reads their names).  GGUFReader builds a
    numpy view per part of every field: ~9 s per open of the 1.7B shape's Q4_K_M file (a 49k-token vocabulary and
    its merges), and a sidecar opened it twice (the tokenizer, the config): writing the sidecar took 19.2 s there,
    now 6.5 s.  tests/unit/test_gguf.py checks that transformers reads the same values from both."""

    def __init__(self, header):
        self.fields = {k: _Field(k, types, parts, list(range(len(parts))))
                       for k, (types, parts) in header.raw_fields.items()}
        self.tensors = header.tensors


def _write_sidecar(gguf: Path, target: Path) -> None:
    from unittest import mock

    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    reader = open_reader(gguf, raw=True)
    arch = architecture(reader)
    logger.info("reading the tokenizer and config of %s (once)", gguf.name)
    # transformers imports GGUFReader from the gguf package at each call (the tokenizer's, the config's): the header
    # read above, in the gguf reader's shape, stands in for it
    fast = _TransformersReader(reader)
    with folder_written_whole(target) as tmp, mock.patch("gguf.GGUFReader", lambda *args, **kwargs: fast):
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tok.save_pretrained(tmp)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [ARCHITECTURES[arch]]
        config["_name_or_path"] = gguf.stem
        config["tie_word_embeddings"] = not any(t.name == "output.weight" for t in reader.tensors)
        config["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id).save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf), "architecture": arch}))


def default_quantization(gguf: Path) -> str | None:
    """`--quantization auto` for a GGUF file: int4 when its layers are 4-bit types, int8 when they are another
    quantized type (Q8_0, Q5_*, Q6_K, ...), the 16-bit float formats for F16 / BF16 layers (exact), none for F32."""
    types = [t.tensor_type.name for t in open_reader(gguf).tensors if t.name.startswith("blk.")
             and t.name.endswith(".weight") and len(t.shape) > 1]
    if not types:
        return None
    main = max(set(types), key=types.count)
    if main in _FOUR_BIT:
        return "int4"
    return {"F32": None, "F16": "fp16", "BF16": "bf16"}.get(main, "int8")
