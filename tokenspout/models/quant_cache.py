"""On-disk cache of quantized models (`--quantization int8 | int4`, and the 16-bit float weights of bf16 | fp16): a warm start maps the file, never re-quantizes.

One safetensors file per (weight files and config.json: absolute path, size and mtime; method; dtype; whether the
kernels run; the source of the modules in _SOURCES; torch version; FORMAT) under $TOKENSPOUT_CACHE/quantized/.  It
holds the quantized model's state (the exact embedding, norms, biases; where the kernels run the linear layers are
QuantLinear modules holding only their packed weight, elsewhere their dequantized float weights are stored too,
since mapping them costs nothing while recomputing them costs ~0.8 s on the default model) and every PackedWeight's
codes / scale / min.  safetensors maps the file, so on a hit the model's parameters are the file's pages: no copy,
no quantization.  Every tensor starts at a multiple of 64 bytes (safetensors' own
writer aligns to 8): the model reads misaligned weights slower (48-token prefill of the default model: 288 ms
misaligned, 227 ms aligned).

Writers quantize under a file lock and write a temporary file that is renamed into place, so a reader never sees
half a file and two processes starting at once quantize once.  A server writes the file after it is ready
(load_or_quantize's defer_write): on this VM buffered writes run at ~0.4 GB/s, so writing the 8B shape's 4.7 GB
took 20-23 s of its first start, the 1.7B's 1.2 GB 3.5 s.  A file that cannot be read or does not match the
model (truncated, foreign, stale, or whose data differs from a digest of sampled windows written with it) is
deleted and rebuilt; any failure to write the cache only costs the next start its time.  Deleting the folder is always safe.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tokenspout.models.default_model import cache_dir
from tokenspout.models.llama import LlamaForCausalLM
from tokenspout.models.quant_linear import linear_shapes, replace_linears
from tokenspout.kernels.cpu import code_row_bytes
from tokenspout.models.quantize import WT_BF16, WT_F16, WT_Q4, WT_Q5, WT_Q6, WT_Q8, PackedWeight

logger = logging.getLogger(__name__)

FORMAT = 3  # bump when the file layout changes (the sources below are hashed into the key as well)
# What the cached values and layout depend on: quantization, weight fusion (loader), the streaming build and the
# GGUF block conversion, this file.
_SOURCES = [Path(__file__).parent / name for name in ("quantize.py", "quant_linear.py", "quant_load.py",
                                                      "gguf_model.py", "checkpoint.py", "loader.py")] + [Path(__file__)]
_MODEL, _PACKED = "model.", "packed."
_ALIGN = 64  # bytes; every tensor of the file starts at a multiple (the map itself is page aligned)
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int8: "I8", torch.uint8: "U8"}


def cache_key(files: list[Path], method: str, dtype: torch.dtype, packed_only: bool = False) -> dict:
    """Everything the cached tensors depend on.  files: the model's weight files and config.json; packed_only: the
    linear layers hold only their packed weights (the kernels run), so the file has no dequantized copy."""
    stats = []
    for f in files:
        st = f.stat()
        stats.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    code = hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES)).hexdigest()[:16]
    return {"format": FORMAT, "method": method, "dtype": str(dtype).removeprefix("torch."), "files": stats,
            "code": code, "torch": torch.__version__, "packed_only": packed_only}


def cache_file(model_dir: Path, key: dict) -> Path:
    """$TOKENSPOUT_CACHE/quantized/<folder>-<path hash>-<method>-<dtype>-<key hash>.safetensors (the prefix names
    one model folder, method and dtype: older files with the same prefix are stale and pruned)."""
    where = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:8]
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "quantized" / f"{model_dir.name}-{where}-{key['method']}-{key['dtype']}-{digest}.safetensors"



def _packed_numels(n: int, k: int, wt: int) -> tuple[int, int, int]:
    """(codes, scale, min) element counts of the kernels' layout (N padded to a multiple of 4, groups of 32)."""
    if wt in (WT_BF16, WT_F16):
        return n * k, 0, 0
    n4 = -(-n // 4) * 4
    groups = n4 * (k // 32)
    return n4 * code_row_bytes(wt, k), groups, groups if wt in (WT_Q4, WT_Q5) else 0


def load(file: Path, key: dict, model: LlamaForCausalLM, dtype: torch.dtype, lib=None,
         discard: bool = False) -> tuple[LlamaForCausalLM, dict[str, PackedWeight]] | None:
    """The cached model (its parameters assigned from the mapped file) and packed weights, or None when the file
    is missing or does not match (discard: then delete it, with a warning; only under the writers' lock).  `model`
    is the model built on the meta device; it is only modified once the whole file has been checked."""
    if not file.is_file():
        return None
    try:
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata() or {}
            if json.loads(meta.get("key", "null")) != key:
                raise ValueError("key mismatch")
            mapped = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("__pad")}  # noqa: SIM118
        if meta.get("sample_sha256") != _sample_digest(mapped):
            raise ValueError("its data differs from what was written (sampled digest)")
        state = {k[len(_MODEL):]: t for k, t in mapped.items() if k.startswith(_MODEL)}
        packed: dict[str, PackedWeight] = {}

        def part(p: str, n: int, k: int, wt: int) -> PackedWeight:
            lo = mapped[p + ".min"] if wt in (WT_Q4, WT_Q5) else None
            return PackedWeight(mapped[p + ".codes"], mapped[p + ".scale"], lo, n, k, wt)

        for name, (n, k, wt, *tail) in json.loads(meta["packed"]).items():
            p = _PACKED + name
            packed[name] = part(p, n, k, wt)
            if tail:  # [tail rows, tail wt]
                packed[name].tail = part(p + ".tail", tail[0], k, tail[1])
        shapes = linear_shapes(model)
        expected = model.state_dict()
        if lib is not None:  # the linear layers will be QuantLinear modules: no float weight of theirs in the file
            expected = {k: v for k, v in expected.items()
                        if not (k.endswith(".weight") and k.removesuffix(".weight") in shapes)}
        if state.keys() != expected.keys():
            raise ValueError(f"tensors {sorted(state.keys() ^ expected.keys())[:3]} differ from the model's")
        for name, t in state.items():
            if t.shape != expected[name].shape or t.dtype != dtype:
                raise ValueError(f"{name}: {t.dtype} {tuple(t.shape)}, expected {dtype} "
                                 f"{tuple(expected[name].shape)}")
        if packed.keys() != shapes.keys():
            raise ValueError("packed weights do not cover the model's linear layers")
        for name, pw in packed.items():
            if (pw.n, pw.k) != shapes[name]:
                raise ValueError(f"packed weight {name} has the wrong size")
            parts = [(pw, pw.n)] if pw.tail is None else [(pw, pw.n - pw.tail.n), (pw.tail, pw.tail.n)]
            for p, rows in parts:
                if p.wt not in (WT_Q8, WT_Q4, WT_Q5, WT_Q6, WT_BF16, WT_F16):
                    raise ValueError(f"packed weight {name} has an unknown format")
                want = _packed_numels(rows, p.k, p.wt)
                got = (p.codes.numel(), p.scale.numel(), 0 if p.min is None else p.min.numel())
                if got != want or rows <= 0 or (
                        pw.tail is not None and (p.wt not in (WT_Q8, WT_Q4, WT_Q5, WT_Q6) or (p is pw and rows % 4))):
                    raise ValueError(f"packed weight {name} has the wrong size")
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
        if discard:
            logger.warning("quantized-weights cache %s is unusable (%s): rebuilding it", file, e)
            file.unlink(missing_ok=True)
        return None
    # assign=True: the parameters become the mapped tensors (no copy); a tied LM head is untied, as quantize_model
    # leaves it (the file holds the exact embedding and the head separately).
    if lib is not None:
        replace_linears(model, packed, lib)
    model.load_state_dict(state, assign=True)
    return model, packed


def save(file: Path, key: dict, model: LlamaForCausalLM, packed: dict[str, PackedWeight]) -> None:
    """Writes the cache file atomically (temporary file + rename) and prunes older files of the same model,
    method and dtype."""
    tensors = {_MODEL + k: v.contiguous() for k, v in model.state_dict().items()}
    for name, pw in packed.items():
        for p, part in ((name, pw), (name + ".tail", pw.tail)):
            if part is None:
                continue
            tensors[f"{_PACKED}{p}.codes"] = part.codes
            tensors[f"{_PACKED}{p}.scale"] = part.scale
            if part.min is not None:
                tensors[f"{_PACKED}{p}.min"] = part.min
    # [n, k, wt] (+ [tail rows, tail wt] for a weight of two formats)
    meta = {"key": json.dumps(key), "packed": json.dumps({
        n: [pw.n, pw.k, pw.wt] + ([pw.tail.n, pw.tail.wt] if pw.tail is not None else []) for n, pw in packed.items()}),
        "sample_sha256": _sample_digest(tensors)}
    for stale in file.parent.glob(f".{_prefix(file)}*.tmp"):  # a writer killed mid-way (we hold the lock now)
        stale.unlink(missing_ok=True)
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")  # unique: writers hold the lock
    try:
        write_aligned(tmp, tensors, meta)
        os.replace(tmp, file)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    for old in file.parent.iterdir():
        if old != file and old.name.startswith(_prefix(file)) and old.suffix == ".safetensors":
            old.unlink(missing_ok=True)
    prune(file.parent)


def prune(folder: Path | None = None, under: Path | None = None) -> list[Path]:
    """Deletes the cache files (in `folder`, default the cache's) made from weight files that are gone or changed
    since, and, given `under`, those made from files below that folder; returns them.  Run after each file written:
    without it the cache of every model folder ever quantized (deleted, moved, a GGUF's sidecar replaced, a test
    run's temporary models) stayed on disk for ever, ~1 GB per test run.  Only the header is read (the key: each
    file's path, size, mtime); a file that cannot be read is left to load()'s check.  Unlinking a file that a
    running server maps is safe: its pages stay until the map goes; a model on a disk not mounted now counts as
    gone (its next start quantizes again)."""
    folder = folder if folder is not None else cache_dir() / "quantized"
    below = under.resolve() if under is not None else None
    pruned = []
    for file in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
        try:
            with safe_open(str(file), framework="pt") as f:
                sources = [(Path(p), size, mtime) for p, size, mtime in json.loads(f.metadata()["key"])["files"]]
        except (SafetensorError, OSError, ValueError, KeyError, TypeError):
            continue
        if below is not None and any(p.is_relative_to(below) for p, _, _ in sources) or any(
                _changed(p, size, mtime) for p, size, mtime in sources):
            file.unlink(missing_ok=True)
            pruned.append(file)
    return pruned


def _changed(path: Path, size: int, mtime_ns: int) -> bool:
    try:
        st = path.stat()
    except FileNotFoundError:
        return True
    except OSError:  # unreadable for now (permissions): not known to be gone
        return False
    return (st.st_size, st.st_mtime_ns) != (size, mtime_ns)


_SAMPLES, _WINDOW = 8, 4096


def _sample_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of each tensor's name and size and of eight 4 KiB windows spread over its bytes, in name order: a file
    damaged at its full size (data zeroed by a crash before the page cache reached the disk, or by hand) had loaded
    silently and answered zeros ever after.  A sample, not a checksum of every byte: ~2 MB read on a warm start of
    any size (the first steps read those pages anyway)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        b = tensors[name].contiguous().view(-1).view(torch.uint8)
        n = b.numel()
        h.update(f"{name}:{n};".encode())
        for o in sorted({0} if n <= _WINDOW else {(n - _WINDOW) * i // (_SAMPLES - 1) for i in range(_SAMPLES)}):
            h.update(b[o : o + _WINDOW].numpy().tobytes())
    return h.hexdigest()


def write_aligned(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Writes a safetensors file in which every tensor starts at a multiple of _ALIGN bytes.  The format allows
    no holes between tensors, so gaps are uint8 tensors named "__pad<i>"; the header is padded with spaces (as
    the format allows) so that the data starts aligned too."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for i, (name, t) in enumerate(tensors.items()):
        if pad := -offset % _ALIGN:
            header[f"__pad{i}"] = {"dtype": "U8", "shape": [pad], "data_offsets": [offset, offset + pad]}
            offset += pad
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(8 + len(head)) % _ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        written = 0
        for name, t in tensors.items():
            start = header[name]["data_offsets"][0]
            f.write(b"\0" * (start - written))
            f.write(t.contiguous().view(-1).view(torch.uint8).numpy().data)
            written = header[name]["data_offsets"][1]


def _prefix(file: Path) -> str:
    """The file name up to the key hash: one model folder, method and dtype."""
    return file.name[: file.name.rindex("-") + 1]


def load_or_quantize(model: LlamaForCausalLM, model_dir: Path, files: list[Path], method: str, dtype: torch.dtype,
                     build: Callable[[], tuple[LlamaForCausalLM, dict[str, PackedWeight]]], lib=None,
                     defer_write: bool = False
                     ) -> tuple[LlamaForCausalLM, dict[str, PackedWeight], Callable[[], None] | None]:
    """The quantized model, its packed weights and the cache write still to do: from the cache, else `build()` (the
    model quantized from the folder's weights in `dtype`), then cached.  `model`: the model built on the meta
    device; `lib`: the C kernels, when they run here (the linear layers then hold only their packed weights).
    defer_write: return the write of a fresh cache file as a callable (None when there is none) instead of doing
    it; the lock stays held until it has run, so a second process starting meanwhile waits, then maps the file."""
    key = cache_key(files, method, dtype, packed_only=lib is not None)
    file = cache_file(model_dir, key)
    hit = load(file, key, model, dtype, lib)
    if hit is not None:
        return *hit, None
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        lock = open(file.parent / f".{_prefix(file)}lock", "w")  # noqa: SIM115 - held across the quantization
    except OSError as e:
        logger.warning("cannot use the quantized-weights cache in %s (%s): quantizing without it", file.parent, e)
        return *build(), None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here, then finds the file written
        hit = load(file, key, model, dtype, lib, discard=True)
        if hit is None:
            m, packed = build()
    except BaseException:
        lock.close()
        raise
    if hit is not None:
        lock.close()
        return *hit, None

    def write() -> None:
        try:
            save(file, key, m, packed)
            logger.info("cached the %s weights in %s", method, file)
        except OSError as e:
            logger.warning("could not write the quantized-weights cache %s: %s", file, e)
        finally:
            lock.close()

    if defer_write:
        return m, packed, write
    write()
    return m, packed, None
