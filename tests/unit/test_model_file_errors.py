"""Malformed model files and folders are clear errors that name the file and the key at fault (never a raw
IndexError / KeyError / ZeroDivisionError / AttributeError from transformers or the loader), a damaged GGUF sidecar
folder is rebuilt, and a path says what it is (a GGUF renamed .bin is still a GGUF file, a folder named x.gguf is
a folder).  The GGUF files here are tiny llama files (2 layers, hidden 64) with a tiny byte-level BPE vocabulary:
the sidecar of a 49k-token vocabulary takes seconds to write, this one's well under one."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFValueType as V
from gguf import GGUFWriter

from tokenspout.config import read_hf_config
from tokenspout.models import gguf_file
from tokenspout.models.checkpoint import weight_files
from tokenspout.models.default_model import resolve_model_path
from tokenspout.models.gguf_file import COMPLETE_FILE, is_gguf, sidecar_folder


def _byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes (transformers' bytes_to_unicode), in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled, extra = {}, 0
    for b in range(256):
        if b in keep:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


TOKENS = [*_byte_alphabet(), "Ġt", "he", "<|endoftext|>"]
EOS = len(TOKENS) - 1
HPARAMS: dict[str, tuple[Any, V]] = {
    "block_count": (2, V.UINT32), "context_length": (256, V.UINT32), "embedding_length": (64, V.UINT32),
    "feed_forward_length": (128, V.UINT32), "attention.head_count": (4, V.UINT32),
    "attention.head_count_kv": (2, V.UINT32), "rope.freq_base": (10000.0, V.FLOAT32),
    "attention.layer_norm_rms_epsilon": (1e-5, V.FLOAT32), "vocab_size": (len(TOKENS), V.UINT32)}
TOKENIZER: dict[str, tuple[Any, V, V | None]] = {
    "tokenizer.ggml.model": ("gpt2", V.STRING, None), "tokenizer.ggml.pre": ("smollm", V.STRING, None),
    "tokenizer.ggml.tokens": (TOKENS, V.ARRAY, V.STRING), "tokenizer.ggml.merges": (["Ġ t", "h e"], V.ARRAY, V.STRING),
    "tokenizer.ggml.token_type": ([1] * (len(TOKENS) - 1) + [3], V.ARRAY, V.INT32),
    "tokenizer.ggml.bos_token_id": (EOS, V.UINT32, None), "tokenizer.ggml.eos_token_id": (EOS, V.UINT32, None),
    "tokenizer.chat_template": ("{% for m in messages %}{{ m['content'] }}{% endfor %}", V.STRING, None)}


def build_gguf(path: Path, hparams: dict | None = None, tokenizer: dict | None = None) -> Path:
    """A tiny llama GGUF; hparams / tokenizer: keys (llama.NAME without the prefix / tokenizer.*) replaced by a
    (value, type[, item type]) or dropped (None)."""
    w = GGUFWriter(str(path), "llama")
    for name, kv in {**HPARAMS, **(hparams or {})}.items():
        if kv is not None:
            w.add_key_value(f"llama.{name}", kv[0], kv[1])
    for key, kv in {**TOKENIZER, **(tokenizer or {})}.items():
        if kv is not None:
            w.add_key_value(key, kv[0], kv[1], sub_type=kv[2] if len(kv) > 2 else None)
    g = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", (g.standard_normal((len(TOKENS), 64)) * 0.05).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        d = tmp_path_factory.mktemp("cache")
        mp.setenv("TOKENSPOUT_CACHE", str(d))
        yield d


@pytest.fixture(scope="module")
def good(cache, tmp_path_factory) -> Path:
    """A well-formed file, its sidecar folder written once for the module (the damage tests leave it whole)."""
    path = build_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    sidecar_folder(path)
    return path


BAD_METADATA = [  # (case, hparams, tokenizer, what the error says)
    ("eos id past the vocabulary", None, {"tokenizer.ggml.eos_token_id": (10**9, V.UINT32)},
     rf"tokenizer.ggml.eos_token_id 1000000000 is outside the vocabulary \({len(TOKENS)} tokens\)"),
    ("bos id past the vocabulary", None, {"tokenizer.ggml.bos_token_id": (10**9, V.UINT32)},
     r"tokenizer.ggml.bos_token_id 1000000000 is outside the vocabulary"),
    ("eos id as a string", None, {"tokenizer.ggml.eos_token_id": ("5", V.STRING)},
     r"tokenizer.ggml.eos_token_id must be an integer token id, got '5'"),
    ("gpt2 without merges", None, {"tokenizer.ggml.merges": None},
     r"a 'gpt2' tokenizer needs tokenizer.ggml.merges, which the file lacks"),
    ("no vocabulary", None, {"tokenizer.ggml.tokens": None}, r"tokenizer.ggml.tokens \(the vocabulary\) is missing"),
    ("no tokenizer", None, {k: None for k in TOKENIZER}, r"has no tokenizer \(no tokenizer.ggml.model\)"),
    ("zero heads", {"attention.head_count": (0, V.UINT32)}, None,
     r"llama.attention.head_count must be an integer >= 1, got 0"),
    ("zero kv heads", {"attention.head_count_kv": (0, V.UINT32)}, None,
     r"llama.attention.head_count_kv must be an integer >= 1, got 0"),
    ("layer count as a string", {"block_count": ("2", V.STRING)}, None,
     r"llama.block_count must be an integer >= 1, got '2'"),
    ("no layer count", {"block_count": None}, None, r"has no llama.block_count"),
    ("no hidden size", {"embedding_length": None}, None, r"has no llama.embedding_length"),
    ("rope base 0", {"rope.freq_base": (0.0, V.FLOAT32)}, None, r"llama.rope.freq_base must be a number > 0, got 0.0"),
]


@pytest.mark.parametrize(("hparams", "tokenizer", "says"), [c[1:] for c in BAD_METADATA],
                         ids=[c[0] for c in BAD_METADATA])
def test_bad_metadata_is_a_clear_error(cache, tmp_path: Path, hparams, tokenizer, says):
    """Checked from the header before transformers' conversion, which failed with an IndexError, a KeyError, a
    ZeroDivisionError or a StrictDataclassFieldValidationError naming neither (or, for a missing layer count or a
    rope base of 0, went on with transformers' default / a model of nan angles)."""
    path = build_gguf(tmp_path / "bad.gguf", hparams, tokenizer)
    with pytest.raises(ValueError, match=rf"GGUF file {path}:? .*{says}"):
        sidecar_folder(path)
    assert not any(p.name.startswith("bad-") for p in (cache / "gguf").iterdir())  # (no folder left behind)


def test_what_transformers_cannot_convert_names_the_file(cache, tmp_path: Path):
    """Past the checks, a failure of transformers' conversion is a ValueError naming the file (the original is its
    __cause__)."""
    path = build_gguf(tmp_path / "odd.gguf", tokenizer={"tokenizer.ggml.model": ("foo", V.STRING)})
    with pytest.raises(ValueError, match=rf"GGUF file {path}: cannot read its tokenizer/config metadata: "
                                         r"ValueError: .*'foo'") as e:
        sidecar_folder(path)
    assert e.value.__cause__ is not None


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


DAMAGE = {
    "truncated tokenizer.json": lambda d: _truncate(d / "tokenizer.json"),
    "deleted config.json": lambda d: (d / "config.json").unlink(),
    "config.json overwritten in place": lambda d: (d / "config.json").write_bytes(
        b"x" * (d / "config.json").stat().st_size),
    "no completion marker (a folder of an older tokenspout)": lambda d: (d / COMPLETE_FILE).unlink(),
    "corrupt completion marker": lambda d: (d / COMPLETE_FILE).write_text("[1, 2"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_sidecar_is_rebuilt(good: Path, damage: str):
    """The folder's files are checked against the digests its completion marker (written last) holds: a damaged
    folder is written again, whole.  It was served as it was: "not a Hugging Face model folder", a tokenizer
    that does not parse, for good."""
    from transformers import AutoTokenizer

    folder = sidecar_folder(good)
    DAMAGE[damage](folder)
    assert sidecar_folder(good) == folder
    assert read_hf_config(folder)["architectures"] == ["LlamaForCausalLM"]
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.eos_token_id == EOS and tok.convert_ids_to_tokens(tok("the").input_ids) == ["t", "he"]
    assert (folder / COMPLETE_FILE).is_file() and gguf_file._is_complete(folder)


def test_concurrent_starts_rebuild_a_damaged_sidecar_once(good: Path, monkeypatch):
    """Two starts that find the folder damaged at once: the file lock lets one rebuild it, the other finds it whole
    (flock locks of two open() calls exclude each other within one process too)."""
    folder = sidecar_folder(good)
    (folder / "config.json").unlink()
    writes = []
    write = gguf_file._write_sidecar
    monkeypatch.setattr(gguf_file, "_write_sidecar", lambda *a: (writes.append(a), write(*a)))
    got: list[Path] = []
    threads = [threading.Thread(target=lambda: got.append(sidecar_folder(good))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [folder, folder] and len(writes) == 1 and gguf_file._is_complete(folder)


def test_a_gguf_file_is_known_by_its_magic_bytes(good: Path, tmp_path: Path):
    """A GGUF renamed .bin is served as a GGUF file (it was "model folder ... does not exist")."""
    renamed = tmp_path / "tiny.bin"
    shutil.copyfile(good, renamed)
    assert is_gguf(renamed)
    folder, name = resolve_model_path(str(renamed))
    assert name == "tiny" and gguf_file.gguf_source(folder) == renamed.resolve()


def test_paths_say_what_they_are(tmp_path: Path):
    """A folder named x.gguf is no missing GGUF file, a file that is not a GGUF is no missing model folder."""
    folder = tmp_path / "x.gguf"
    folder.mkdir()
    assert not is_gguf(folder)
    with pytest.raises(ValueError, match=r"x.gguf is a folder, not a GGUF file"):
        resolve_model_path(str(folder))
    with pytest.raises(ValueError, match=r"x.gguf is a folder, not a GGUF file"):
        sidecar_folder(folder)
    other = tmp_path / "model.bin"
    other.write_bytes(b"\0" * 64)
    assert not is_gguf(other)
    with pytest.raises(ValueError, match=r"model.bin is a file, not a model folder, and not a GGUF file"):
        resolve_model_path(str(other))
    with pytest.raises(ValueError, match=r"model.bin is a file, not a model folder"):
        read_hf_config(other)
    with pytest.raises(FileNotFoundError, match=r"GGUF file .*missing.gguf does not exist"):
        resolve_model_path(str(tmp_path / "missing.gguf"))


@pytest.mark.parametrize(("config", "says"), [
    ("[]", r"config.json must be a JSON object, got list"),
    ('"LlamaForCausalLM"', r"config.json must be a JSON object, got str"),
    (json.dumps({"architectures": "LlamaForCausalLM", "model_type": "llama"}),
     r"config.json: architectures must be a list of class names, got 'LlamaForCausalLM'"),
])
def test_a_config_that_is_not_an_object_is_a_clear_error(tmp_path: Path, config: str, says: str):
    from tokenspout.models.loader import load_hf_config

    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ValueError, match=says):
        load_hf_config(tmp_path)


@pytest.mark.parametrize(("index", "says"), [
    ('{"weight_map": []}', r"weight_map must be an object mapping tensor names to files"),
    ('{"weight_map": {"model.norm.weight": 3}}', r"weight_map must be an object mapping tensor names to files"),
    ("[]", r"it must be a JSON object with a weight_map"),
])
def test_a_corrupt_safetensors_index_is_a_clear_error(tmp_path: Path, index: str, says: str):
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ValueError, match=rf"model.safetensors.index.json is corrupt: {says}"):
        weight_files(tmp_path)
