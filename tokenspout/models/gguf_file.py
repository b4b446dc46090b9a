"""GGUF files, the part without torch (the API server imports it): recognising a GGUF path, its architecture, and
the sidecar folder (config.json, tokenizer files, chat template, generation config, gguf_source.json) that stands
for the file everywhere a model folder is expected.  The weights are read by models/gguf_model.py.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from tokenspout.checks import is_int, is_number
from tokenspout.models.cache_dir import cache_dir, folder_written_whole

logger = logging.getLogger(__name__)

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
SOURCE_FILE = "gguf_source.json"
# written last into a sidecar folder: the sha256 of every other file (a folder without it, or whose files differ, is
# rebuilt; a truncated tokenizer.json or a deleted config.json had made a lasting "not a Hugging Face model folder")
COMPLETE_FILE = "sidecar_complete.json"
_MAGIC = b"GGUF"  # (gguf_header.MAGIC: not imported from there, it imports numpy and the API server imports this)
# 4-bit types on a uniform grid (int4 holds them exactly, or to float16 scales).  IQ4_NL / IQ4_XS use 16 non-uniform
# levels: re-fitted to int4 they erred by 5% of each tensor's largest weight (Q6_K re-fitted to int8: 0.4%), so
# they go to int8 like the other types int4 cannot hold (audit 2026-11-27)
_FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")


def is_gguf(path: Path) -> bool:
    """A file named *.gguf, or any file that starts with the GGUF magic bytes (a GGUF renamed .bin was taken for a
    model folder that "does not exist"); a folder never is, whatever its name.  A missing path counts by its name, so
    a missing x.gguf is reported as a missing GGUF file."""
    path = path.expanduser()
    if path.is_dir():
        return False
    return path.suffix.lower() == ".gguf" or (path.is_file() and _starts_with_magic(path))


def _starts_with_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(_MAGIC)) == _MAGIC
    except OSError:
        return False


def _need_file(gguf: Path) -> None:
    if gguf.is_dir():
        raise ValueError(f"{gguf} is a folder, not a GGUF file")
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file {gguf} does not exist")


def gguf_source(folder: Path) -> Path | None:
    """The GGUF file a sidecar folder stands for (None: an ordinary model folder)."""
    marker = folder / SOURCE_FILE
    return Path(json.loads(marker.read_text())["gguf"]) if marker.is_file() else None


def open_reader(gguf: Path, raw: bool = False):
    """The header of `gguf` (models/gguf_header.py: metadata scalars, tensors as views of the memory-mapped file;
    raw: every field as transformers reads it too), or a ValueError naming the file when it is not a GGUF file,
    truncated or corrupt."""
    from tokenspout.models.gguf_header import GGUFHeader

    _need_file(gguf)
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
        name = Path(getattr(reader.data, "filename", None) or "").name
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
                         + (f": {name}" if name else ""))
    return arch


def sidecar_folder(gguf: Path) -> Path:
    """The folder (config, tokenizer, template) of a GGUF file, written once per file (path, size, mtime)."""
    gguf = gguf.expanduser().resolve()
    _need_file(gguf)
    target = cache_dir() / "gguf" / _sidecar_name(gguf)
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here, then finds the folder whole
        if not _is_complete(target):
            if target.exists():
                logger.warning("the sidecar folder %s of %s is incomplete or damaged: rebuilding it", target, gguf.name)
            _write_sidecar(gguf, target)  # (replaces a damaged folder whole: folder_written_whole)
            prune_sidecars()
    return target


# Bumped when what a sidecar folder holds changes (2: RoPE scaling from the file's metadata; 3: head_dim from
# attention.key_length; 4: YaRN's attention factor): older folders are then another name, rebuilt once, and pruned.
_SIDECAR_VERSION = 4


def _sidecar_name(gguf: Path) -> str:
    """<stem>-<hash of the resolved path, size, mtime and _SIDECAR_VERSION>: a file replaced in place gets a new
    folder."""
    st = gguf.stat()
    key = f"{gguf}:{st.st_size}:{st.st_mtime_ns}:{_SIDECAR_VERSION}"
    return f"{gguf.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def prune_sidecars(under: Path | None = None) -> list[Path]:
    """Deletes the sidecar folders whose GGUF file is gone or was changed since (its folder is now another one), and,
    given `under`, those of files below that folder; returns them.  Run after each sidecar written: without it every
    GGUF ever served (or replaced, or made in a temporary folder by a test run) kept its folder for ever.  A folder
    without its source marker is left to sidecar_folder's rebuild; a server still running from a pruned folder has
    read it already."""
    root, pruned = cache_dir() / "gguf", []
    below = under.resolve() if under is not None else None
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        if folder.name.startswith(".") or not folder.is_dir():
            continue  # a lock file, or a folder being written (folder_written_whole's temporary name)
        try:
            src = gguf_source(folder)
            if src is None:
                continue
            gone = not src.is_file() or _sidecar_name(src) != folder.name
        except (OSError, ValueError, TypeError, KeyError):
            continue
        if gone or (below is not None and src.is_relative_to(below)):
            shutil.rmtree(folder, ignore_errors=True)
            pruned.append(folder)
    return pruned


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _is_complete(folder: Path) -> bool:
    """Whether a sidecar folder is whole: its COMPLETE_FILE lists config.json and SOURCE_FILE, and every file it
    lists has the bytes written (~3 ms where the vocabulary has 49k tokens: tokenizer.json is the bulk)."""
    try:
        listed = json.loads((folder / COMPLETE_FILE).read_text())
        return (isinstance(listed, dict) and {"config.json", SOURCE_FILE} <= listed.keys()
                and all(_digest(folder / name) == digest for name, digest in listed.items()))
    except (OSError, ValueError, TypeError):  # a missing or unreadable file, a corrupt marker
        return False


def _mark_complete(folder: Path) -> None:
    """Writes COMPLETE_FILE, last, after every other file of the folder (whole: written beside, then renamed)."""
    digests = {p.name: _digest(p) for p in sorted(folder.iterdir()) if p.is_file()}
    part = folder / f".{COMPLETE_FILE}.part"
    part.write_text(json.dumps(digests, indent=1))
    os.replace(part, folder / COMPLETE_FILE)


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
    from transformers import GenerationConfig

    reader = open_reader(gguf, raw=True)
    arch = architecture(reader)
    _check_hparams(gguf, reader.fields, arch)
    _check_tokenizer(gguf, reader)
    logger.info("reading the tokenizer and config of %s (once)", gguf.name)
    tok, config = _converted_metadata(gguf, _TransformersReader(reader))
    with folder_written_whole(target) as tmp:
        tok.save_pretrained(tmp)
        config.pop("quantization_config", None)
        config["architectures"] = [ARCHITECTURES[arch]]
        config["_name_or_path"] = gguf.stem
        config["tie_word_embeddings"] = not any(t.name == "output.weight" for t in reader.tensors)
        config["dtype"] = "float32"
        config["rope_parameters"] = rope_parameters(gguf, reader, arch, config.get("rope_parameters") or {})
        config["head_dim"] = head_dim(gguf, reader, arch, config)
        config.pop("rope_scaling", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id).save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf), "architecture": arch}))
        _mark_complete(tmp)


def _converted_metadata(gguf: Path, fast: _TransformersReader) -> tuple:
    """(tokenizer, config dict) of transformers' GGUF conversion.  What it raises past the checks below (an
    IndexError, a KeyError, huggingface_hub's validation error, naming neither the file nor the key) is re-raised
    as a ValueError naming the file."""
    from unittest import mock

    from transformers import AutoConfig, AutoTokenizer

    try:
        # transformers imports GGUFReader from the gguf package at each call (the tokenizer's, the config's): the
        # header read once, in the gguf reader's shape, stands in for it
        with mock.patch("gguf.GGUFReader", lambda *args, **kwargs: fast):
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).to_dict()
    except Exception as e:  # noqa: BLE001 - whatever a malformed value makes of transformers' conversion
        raise ValueError(f"GGUF file {gguf}: cannot read its tokenizer/config metadata: {type(e).__name__}: {e}") from e
    return tok, config


# {arch}.NAME hyperparameters transformers' config conversion reads: integers >= 1 (a count or size of 0 is no
# model: head_count 0 was a ZeroDivisionError), the first three required (a missing one became transformers'
# default, e.g. 32 layers of 4096, and a confusing tensor-shape error later)
_REQUIRED_HPARAMS = ("block_count", "embedding_length", "attention.head_count")
_POSITIVE_INT_HPARAMS = (*_REQUIRED_HPARAMS, "feed_forward_length", "context_length", "attention.head_count_kv",
                         "attention.key_length", "attention.value_length", "rope.dimension_count", "vocab_size")
# tokenizer.ggml.model -> the arrays its conversion cannot do without (one of them): a gpt2 tokenizer without
# merges was a KeyError: 'scores'
_TOKENIZER_NEEDS = {"gpt2": ("tokenizer.ggml.merges",), "llama": ("tokenizer.ggml.merges", "tokenizer.ggml.scores"),
                    "t5": ("tokenizer.ggml.scores",)}
# the special tokens transformers looks up in the vocabulary (llama.cpp ignores a bad one of the others)
_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")


def _is_finite(v) -> bool:
    return is_number(v) and math.isfinite(v)


def _key_of(fields: dict, arch: str, name: str) -> str:
    """The key of hyperparameter NAME (a "mistral" file may carry llama's keys, as llama.cpp writes Mistral 7B)."""
    return f"{arch}.{name}" if f"{arch}.{name}" in fields or f"llama.{name}" not in fields else f"llama.{name}"


def head_dim(gguf: Path, reader, arch: str, converted: dict) -> int:
    """A head's width: `attention.key_length`, which llama.cpp writes where it is not hidden / heads (Qwen3, Mistral
    Nemo).  transformers' conversion drops it, and its config class's default stood in: Qwen3Config's 128 (right for
    every published Qwen3, wrong for a 64-wide head: a start error), LlamaConfig's hidden / heads (Nemo: 160, not
    128)."""
    key = field(reader, _key_of(reader.fields, arch, "attention.key_length"))
    value = field(reader, _key_of(reader.fields, arch, "attention.value_length"))
    if key is None:
        return converted["hidden_size"] // converted["num_attention_heads"]
    if value is not None and value != key:
        raise ValueError(f"GGUF file {gguf}: attention.key_length {key} and value_length {value} differ "
                         "(heads of two widths are not supported)")
    return int(key)


def rope_parameters(gguf: Path, reader, arch: str, converted: dict) -> dict:
    """The RoPE parameters of the file (`converted`: transformers' conversion's, which keep only the base
    frequency): `rope.scaling.type` linear or yarn with its factor (and yarn's original context length and betas)
    as transformers' rope_parameters.  Served without them, a linear-scaled file's logits were off by ~19 on a tiny
    model (audit 2026-11-27).  Llama 3.1+ files carry their llama3 scaling as a `rope_freqs` tensor instead: the
    loader divides the frequencies by it (gguf_model.GGUFCheckpoint.rope_freq_factors)."""
    def value(name: str):
        return field(reader, _key_of(reader.fields, arch, name))

    def positive(name: str) -> float | None:
        v = value(name)
        if v is not None and not (_is_finite(v) and v > 0):
            raise ValueError(f"GGUF file {gguf}: {name} must be a positive number, got {v!r}")
        return None if v is None else float(v)

    params = dict(converted)
    kind = value("rope.scaling.type")
    # rope.scaling.attn_factor: a multiplier of the rotated q / k that llama.cpp applies on top of any scaling
    # (1 unless a file states another; llama.cpp's converter never writes it for these architectures)
    attn = positive("rope.scaling.attn_factor") or 1.0
    if attn != 1.0 and kind in (None, "none", "", "linear"):
        raise ValueError(f"GGUF file {gguf}: rope.scaling.attn_factor {attn:g} is supported with YaRN scaling only, "
                         f"not with {kind or 'none'!r}")
    if kind in (None, "none", ""):
        return params
    factor = value("rope.scaling.factor")
    if not (_is_finite(factor) and factor >= 1):
        raise ValueError(f"GGUF file {gguf}: RoPE scaling {kind!r} needs rope.scaling.factor >= 1, got {factor!r}")
    if kind == "linear":
        return {**params, "rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = value("rope.scaling.original_context_length")
        if not (is_int(original) and original >= 1):
            raise ValueError(f"GGUF file {gguf}: YaRN scaling needs rope.scaling.original_context_length, got "
                             f"{original!r}")
        params.update(rope_type="yarn", factor=float(factor), original_max_position_embeddings=original)
        for key, name in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
            if _is_finite(beta := value(key)):
                params[name] = float(beta)
        # the model's own attention factor, which llama.cpp's converter copies from `attention_factor` (llama.cpp
        # b11434 itself ignores it for these architectures and keeps YaRN's default, 0.1 ln(factor) + 1: served
        # that way, a tiny model stating 0.8 had its logits off by 8.4); times attn_factor
        yarn_attn = positive("rope.scaling.yarn_attn_factor")
        if yarn_attn is not None or attn != 1.0:
            base = yarn_attn if yarn_attn is not None else 0.1 * math.log(float(factor)) + 1.0
            params["attention_factor"] = attn * base
        return params
    raise ValueError(f"GGUF file {gguf}: RoPE scaling type {kind!r} is not supported (none, linear, yarn)")


def _check_hparams(gguf: Path, fields: dict, arch: str) -> None:
    """The hyperparameters, checked from the header (`fields`: scalars, and per-layer arrays as lists)."""

    def key_of(name: str) -> str:
        return _key_of(fields, arch, name)

    for name in _REQUIRED_HPARAMS:
        if key_of(name) not in fields:
            raise ValueError(f"GGUF file {gguf} has no {arch}.{name} (the model's shape is unknown without it)")
    for name in _POSITIVE_INT_HPARAMS:
        v = fields.get(key := key_of(name))
        items = v if isinstance(v, list) and v else [v]
        if v is not None and not all(is_int(x) and x >= 1 for x in items):
            raise ValueError(f"GGUF file {gguf}: {key} must be an integer >= 1, got {v!r}")
    theta = fields.get(key := key_of("rope.freq_base"))
    if theta is not None and not (_is_finite(theta) and theta > 0):  # (a base of 0: every rotation angle inf / nan)
        raise ValueError(f"GGUF file {gguf}: {key} must be a number > 0, got {theta!r}")
    eps = fields.get(key := key_of("attention.layer_norm_rms_epsilon"))
    if eps is not None and not (_is_finite(eps) and eps >= 0):
        raise ValueError(f"GGUF file {gguf}: {key} must be a number >= 0, got {eps!r}")


def _check_tokenizer(gguf: Path, header) -> None:
    """The tokenizer metadata transformers' conversion indexes without a check (`header` read with raw=True: the
    vocabulary and merges are in raw_fields only)."""
    from tokenspout.models.gguf_header import _ARRAY, _STRING

    kind = header.fields.get("tokenizer.ggml.model")
    if kind is None:
        raise ValueError(f"GGUF file {gguf} has no tokenizer (no tokenizer.ggml.model): tokenspout serves a GGUF "
                         "file with the tokenizer it carries")
    tokens = header.raw_fields.get("tokenizer.ggml.tokens")
    if tokens is None or tokens[0] != [_ARRAY, _STRING] or not tokens[1]:
        raise ValueError(f"GGUF file {gguf}: tokenizer.ggml.tokens (the vocabulary) is missing or not a list of "
                         "strings")
    n = len(tokens[1])
    for name in _SPECIAL_IDS:
        v = header.fields.get(key := f"tokenizer.ggml.{name}")
        if v is not None and not is_int(v):
            raise ValueError(f"GGUF file {gguf}: {key} must be an integer token id, got {v!r}")
        if v is not None and not 0 <= v < n:
            raise ValueError(f"GGUF file {gguf}: {key} {v} is outside the vocabulary ({n} tokens)")
    needs = _TOKENIZER_NEEDS.get(kind, ())
    if needs and not any(k in header.raw_fields for k in needs):
        raise ValueError(f"GGUF file {gguf}: a {kind!r} tokenizer needs {' or '.join(needs)}, which the file lacks")


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
