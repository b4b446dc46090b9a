"""A GGUF file's header read in one pass: its scalar metadata and its tensors' names, types, shapes and data (numpy
views of the memory-mapped file).

The gguf package's GGUFReader builds a numpy view for every part of every metadata value, so a file carrying a
49k-token vocabulary and its merges (~100k strings) takes 4.3-4.7 s to open on this machine (measured on the 1.7B
and 8B shapes' Q4_K_M files), and a GGUF serve opened it three times (the CLI's `--quantization auto`, the weights,
the embedding).  Here arrays are skipped (string arrays by walking their lengths) and only scalars are decoded:
~0.1 s.  Tensors come out as the gguf package presents them (`tensor_type` a GGMLQuantizationType, `shape` the
GGUF dims innermost first, `data` typed like its reader's: float arrays for F32 / F16 / F64 / the integer types,
byte rows for the quantized ones), so its `dequantize` takes them unchanged.  The tokenizer arrays, which only the
one-time sidecar folder needs, are kept with `raw=True` (models/gguf_file.py hands them to transformers' GGUF
tokenizer and config conversion in the shape of the gguf package's reader fields).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# metadata value types: struct format of the scalar ones (8 = string, 9 = array)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# most tensors, metadata entries and dimensions a header may declare (llama.cpp: GGML_MAX_DIMS = 4)
MAX_COUNT, MAX_DIMS = 1 << 24, 4
MAX_ARRAY = 1 << 24  # items of one metadata array (vocabularies and merges hold ~10^5: a hostile count stops here)
SMALL_ARRAY = 4096
_PLAIN = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
          "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: innermost dimension first
    n_elements: int
    n_bytes: int
    data_offset: int  # absolute, in the file
    data: np.ndarray


class GGUFHeader:
    """`fields`: metadata key -> value (ints, floats, bools, strings, and numeric arrays of up to SMALL_ARRAY items
    as lists; longer and string arrays are left out), `tensors` in file
    order, `data`: the whole file as a read-only np.memmap (its `_mmap` is what pages are released through).
    Raises ValueError on anything malformed: a bad magic or version, a length that runs past the end of the file,
    an unknown type, a duplicate tensor, tensor data outside the file."""

    def __init__(self, path: Path, raw: bool = False):
        """raw: also keep every metadata value as the gguf package's reader presents it to transformers, in
        `raw_fields` (key -> (value types, parts: one per item)), arrays of any length and strings included."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.data = np.memmap(path, mode="r")
        buf = memoryview(self.data._mmap)  # type: ignore[attr-defined]  # (zero-copy: struct reads the mapped pages)
        size = len(buf)
        off = 0

        def take(fmt: str) -> Any:
            nonlocal off
            n = struct.calcsize(fmt)
            if off + n > size:
                raise ValueError(f"the header runs past the end of the file (at byte {off})")
            (v,) = struct.unpack_from(fmt, buf, off)
            off += n
            return v

        def string() -> str:
            nonlocal off
            n = take("<Q")
            if off + n > size:
                raise ValueError(f"a string of {n} bytes runs past the end of the file (at byte {off})")
            s = bytes(buf[off : off + n]).decode("utf-8", errors="replace")
            off += n
            return s

        def array(key: str) -> list | None:
            """A numeric array of up to SMALL_ARRAY items as a list (e.g. per-layer head counts); any other is
            skipped (None).  raw: every array of numbers or strings goes to raw_fields too."""
            nonlocal off
            kind, count = take("<I"), take("<Q")
            if count > MAX_ARRAY:
                raise ValueError(f"metadata {key!r} declares an array of {count} items")
            if kind == _STRING:
                items = []
                for _ in range(count):
                    n = take("<Q")
                    if off + n > size:
                        raise ValueError("a string array runs past the end of the file")
                    if raw:
                        items.append(bytes(buf[off : off + n]))
                    off += n
                if raw:
                    self.raw_fields[key] = ([_ARRAY, _STRING], items)
                return None
            if kind in _SCALAR:
                n = count * struct.calcsize(_SCALAR[kind])
                if off + n > size:
                    raise ValueError("an array runs past the end of the file")
                values = None
                if raw or count <= SMALL_ARRAY:
                    values = np.frombuffer(buf, dtype="<" + _SCALAR[kind], count=count, offset=off).tolist()
                    if raw:
                        self.raw_fields[key] = ([_ARRAY, kind], [(v,) for v in values])
                off += n
                return values if count <= SMALL_ARRAY else None
            if kind == _ARRAY:  # (arrays of arrays: no Llama-family key has one; skipped)
                for _ in range(count):
                    array(key)
                self.raw_fields.pop(key, None)
                return None
            raise ValueError(f"unknown metadata array type {kind}")

        if bytes(buf[:4]) != MAGIC:
            raise ValueError("GGUF magic invalid")
        off = 4
        version = take("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3; a big-endian file reads as another)")
        n_tensors, n_kv = take("<Q"), take("<Q")
        if n_tensors > MAX_COUNT or n_kv > MAX_COUNT:
            raise ValueError(f"the header declares {n_tensors} tensors and {n_kv} metadata entries")
        self.fields: dict[str, Any] = {}
        self.raw_fields: dict[str, tuple[list[int], list]] = {}
        for _ in range(n_kv):
            key, kind = string(), take("<I")
            if kind == _STRING:
                self.fields[key] = string()
                if raw:
                    self.raw_fields[key] = ([_STRING], [self.fields[key].encode()])
            elif kind == _ARRAY:
                if (items := array(key)) is not None:
                    self.fields[key] = items
            elif kind in _SCALAR:
                self.fields[key] = take("<" + _SCALAR[kind])
                if raw:
                    self.raw_fields[key] = ([kind], [(self.fields[key],)])
            else:
                raise ValueError(f"metadata {key!r} has unknown type {kind}")
        infos = []
        for _ in range(n_tensors):
            name, n_dims = string(), take("<I")
            if n_dims > MAX_DIMS:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
            dims = tuple(take("<Q") for _ in range(n_dims))
            infos.append((name, dims, take("<I"), take("<Q")))
        align = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ValueError(f"general.alignment {align!r} is not a power of two")
        start = -(-off // align) * align
        self.tensors: list[GGUFTensor] = []
        seen: set[str] = set()
        for name, dims, raw_type, rel in infos:
            if name in seen:
                raise ValueError(f"duplicate tensor {name!r}")
            seen.add(name)
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise ValueError(f"tensor {name!r} has unknown type {raw_type}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(dims, dtype=np.int64)) if dims else 1
            if dims and dims[0] % block:
                raise ValueError(f"tensor {name!r}: {dims[0]} columns is not a multiple of {qtype.name}'s {block}")
            n_bytes, at = n // block * type_size, start + rel
            if at + n_bytes > size:
                raise ValueError(f"tensor {name!r} ({n_bytes} bytes at {at}) runs past the end of the file ({size})")
            rev = tuple(reversed(dims))
            plain = _PLAIN.get(qtype.name)
            if plain is not None:
                data = np.frombuffer(self.data, dtype=plain, count=n, offset=at).reshape(rev)
            else:  # rows of blocks, as bytes
                data = np.frombuffer(self.data, dtype=np.uint8, count=n_bytes, offset=at).reshape(
                    *rev[:-1], rev[-1] // block * type_size)
            self.tensors.append(GGUFTensor(name, qtype, dims, n, n_bytes, at, data))
