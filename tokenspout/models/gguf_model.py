"""GGUF files served directly: `tokenspout serve model.gguf` (or --model model.gguf).

A GGUF file holds the weights, the tokenizer and the chat template.  What is not weights goes once into a small
"sidecar" folder under $TOKENSPOUT_CACHE/gguf/ (models/gguf_file.py), so the rest of tokenspout sees a model folder;
the weights are never copied there: `GGUFCheckpoint` reads them tensor by tensor from the memory-mapped file (the
header parsed by models/gguf_header.py; blocks dequantized by the gguf package where they are not converted).

Weights, per GGUF tensor type:
* Q4_0, Q4_1 (4-bit, blocks of 32) become the kernels' int4 format and Q8_0 their int8 format exactly (block for
  block: same codes, the same float16 scale and minimum; Q4_0's minimum is -8 x its scale), so
  `--quantization int4` of a Q4_0 / Q4_1 file (int8 of a Q8_0 file) computes with the file's own weight values
  (with the C kernels written in one C pass from the mapped file into the packed weight: cpu.blocks_into);
* Q4_K becomes int4 with the file's codes (each group's scale d x sc and min dmin x m rounded to float16);
* where the C kernels run, Q5_0, Q5_1 and Q5_K become their int5 format with the file's codes (Q5_0's min is -16 x
  its scale, exact; Q5_K's terms rounded to float16 as Q4_K's), and Q6_K their int6 format with the file's codes,
  sub-block scales and d (its values exactly; csrc/quant_cpu.c); elsewhere Q5_0 becomes int8 exactly (its codes - 16);
  every other type (F32, F16, BF16, ...), and Q5_1 / Q5_K / Q6_K without the kernels, is dequantized by the gguf
  package (Q6_K by q6k_rows) and then quantized like any float checkpoint (lossy for the K-quants: their 16- and
  32-weight sub-block scales are re-fitted per group of 32).
llama.cpp's converter permutes the rows of Q and K of Llama / Mistral models (its RoPE pairs interleaved dimensions);
they are permuted back here, on whole rows, so the packed blocks need no dequantization for it.
"""

from __future__ import annotations

import functools
import mmap
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenspout.kernels.cpu import (
    WT_Q4,
    WT_Q5,
    WT_Q6,
    WT_Q8,
    blocks_into,
    k_int8_into,
    pack_into,
    q4k_into,
    q5_into,
    q6k_into,
)
from tokenspout.models.gguf_file import architecture, field, open_reader
from tokenspout.models.quantize import GROUP, PackedWeight, empty_packed, pack_int4, pack_int8

_PERMUTED = ("llama", "mistral")  # llama.cpp's converter permutes Q/K rows for these
# GGUF tensor types by name (gguf.GGMLQuantizationType); what converts exactly to which kernel format
_EXACT = {"Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4", "Q5_0": "int8", "Q8_0": "int8"}
# ... where the C kernels convert them (int5 and int6 are written by csrc/quant_cpu.c only)
_EXACT_C = {**_EXACT, "Q5_0": "int5", "Q5_1": "int5", "Q5_K": "int5", "Q6_K": "int6"}
_WT = {"int4": WT_Q4, "int5": WT_Q5, "int6": WT_Q6, "int8": WT_Q8}
# Types kept at more than 4 bits (llama.cpp's _M / _L mixes keep some tensors at Q5 / Q6 / Q8 on purpose): asked for
# int4, such a tensor is served as int8 instead, re-quantized from its dequantized values (where no exact or C
# conversion applies: without the kernels).
_WIDER = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_K")
# Types the C kernels dequantize and quantize to int8 in one pass (csrc/quant_cpu.c), with the values of the gguf
# package's dequantization quantized by quantize_int8, when int4 or int8 is asked, in a layer whose parts form more
# than two formats (a Q5_K_M file's Q8_0 / Q5_K / Q6_K: converted part by part to int8, the exact int8 parts keeping
# their values)
_C_INT8 = ("Q5_K", "Q6_K")


@functools.cache
def _readable(qtype: Any) -> bool:
    """Whether the gguf package dequantizes this tensor type (it has no code for Q8_1, Q8_K, the integer types, F64,
    Q1_0: a bare NotImplementedError at the first read otherwise), probed once per type on one zero block."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    try:
        dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _gguf_name(name: str) -> str:
    """HF parameter name (no "model." prefix) -> GGUF tensor name."""
    fixed = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if name in fixed:
        return fixed[name]
    parts = name.split(".")  # layers.{i}.{module}.{proj}.{weight|bias}
    if parts[0] != "layers" or len(parts) < 4:
        raise ValueError(f"weights are missing tensor {name!r}")
    sub = ".".join(parts[2:-1])
    table = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    if sub not in table:
        raise ValueError(f"weights are missing tensor {name!r}")
    return f"blk.{parts[1]}.{table[sub]}.{parts[-1]}"


class GGUFCheckpoint:
    """A GGUF file's tensors by HF name (the interface of checkpoint.CheckpointReader), read lazily from the map."""

    def __init__(self, gguf: Path):
        self.path = gguf
        self.reader = open_reader(gguf)
        self.arch = architecture(self.reader)
        self.tensors = {t.name: t for t in self.reader.tensors}

        def hparam(name: str):  # (a "mistral" file may carry llama's keys, as llama.cpp writes Mistral 7B as llama)
            return field(self.reader, f"{self.arch}.{name}") or field(self.reader, f"llama.{name}")

        self.n_head = hparam("attention.head_count")
        self.n_kv = hparam("attention.head_count_kv") or self.n_head

    def _release(self, t) -> None:
        """Drops the pages of tensor `t` from this process's mapping once it has been converted: a map that is read
        through keeps every page it touched counted in the RSS until it is closed (a whole 1 GB file during a
        load).  The pages stay in the page cache; a later read maps them again."""
        mm = getattr(self.reader.data, "_mmap", None)
        if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = int(t.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, int(t.data_offset) + int(t.n_bytes) - start)
        except (OSError, ValueError):
            pass

    def _tensor(self, name: str):
        g = _gguf_name(name)
        if g not in self.tensors:
            raise ValueError(f"weights are missing tensor {name!r} ({g} in {self.path.name})")
        t = self.tensors[g]
        if not _readable(t.tensor_type):
            raise ValueError(f"unsupported GGUF tensor type {t.tensor_type.name} for tensor {g} in {self.path.name}")
        return t

    def _permuted(self, name: str) -> bool:
        """Whether llama.cpp's converter permuted this tensor's rows (Q and K of Llama / Mistral files)."""
        return self.arch in _PERMUTED and (name.endswith("q_proj.weight") or name.endswith("k_proj.weight"))

    def _unpermute(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Undoes llama.cpp's Q/K row permutation (on whole rows: float rows or rows of quantized blocks)."""
        if not self._permuted(name):
            return rows
        heads = self.n_head if name.endswith("q_proj.weight") else self.n_kv
        n = rows.shape[0]
        return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)

    def get(self, name: str) -> torch.Tensor:
        """The tensor as float32 (dequantized where the file holds it quantized), in HF's layout."""
        from gguf.quants import dequantize

        t = self._tensor(name)
        shape = self.shape(name)
        raw = np.asarray(t.data)
        if len(shape) == 1:
            out = np.array(dequantize(raw, t.tensor_type), dtype=np.float32).reshape(shape)
        else:  # in slices of rows: the gguf package's dequantization makes several temporaries of its input's size
            out = np.empty(shape, dtype=np.float32)
            rows = raw.reshape(shape[0], -1)
            for r0 in range(0, shape[0], 4096):
                out[r0 : r0 + 4096] = dequantize(rows[r0 : r0 + 4096], t.tensor_type).reshape(-1, shape[1])
        self._release(t)
        return torch.from_numpy(np.ascontiguousarray(self._unpermute(name, out)))

    def rows(self, name: str) -> _Rows:
        """The 2-D tensor as float32 rows dequantized on demand (slices of rows, in HF's layout): what quantize_rows
        re-quantizes a chunk at a time, so no float copy of a whole tensor is made (an 8B shape's Q6_K LM head would
        be 0.8 GB of it)."""
        return _Rows(self, name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(x) for x in reversed(self._tensor(name).shape))  # GGUF lists dims innermost first

    def layer_count(self) -> int:
        """1 + the highest block index among the tensors (blk.{i}.*)."""
        return 1 + max((int(n.split(".")[1]) for n in self.tensors if n.startswith("blk.")
                        and n.split(".")[1].isdigit()), default=-1)

    def warn_unused(self, plan: dict[str, list[str]]) -> None:
        pass  # (llama.cpp files carry tensors tokenspout reads apart, e.g. rope_freqs)

    def rope_freq_factors(self, head_dim: int) -> torch.Tensor | None:
        """`rope_freqs.weight`: what llama.cpp divides each rotary frequency by (how its converter stores Llama
        3.1+'s llama3 scaling: no rope.scaling keys then).  Ignored, a Llama 3.1 file was served with unscaled
        frequencies: logits off by ~21 on a tiny model, wrong long-range positions on a real one (audit)."""
        t = self.tensors.get("rope_freqs.weight")
        if t is None:
            return None
        from gguf.quants import dequantize

        factors = torch.from_numpy(np.array(dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32)).reshape(-1)
        if factors.numel() != head_dim // 2 or not bool(torch.isfinite(factors).all()) or bool((factors <= 0).any()):
            raise ValueError(f"{self.path.name}: rope_freqs must hold {head_dim // 2} positive factors, got "
                             f"{factors.numel()} values")
        return factors

    def type_name(self, name: str) -> str:
        return self._tensor(name).tensor_type.name

    def packed(self, names: list[str], method: str, lib=None) -> PackedWeight | None:
        """The tensors `names` (stacked rows, e.g. q, k, v) in the kernels' formats, following the file: blocks that
        convert directly keep their values whatever `method` asks (Q4_0 / Q4_1 / Q4_K -> int4, Q8_0 -> int8, and
        with the C kernels `lib` Q5_0 / Q5_1 / Q5_K -> int5; Q5_0 -> int8 without them: never re-rounded onto
        another grid); with them Q6_K becomes int6 (exact) when int4 or int8 is asked, and without the kernels a
        tensor the file keeps at 5-8 bits in another type (Q5_1, Q5_K, Q6_K) becomes int8 when int4 is asked.  A fused
        layer of two such formats (a Q4_K_M file's Q4_K q / k with a Q6_K v, Q5_0 q / k with a Q8_0 v) keeps each
        part's format when int4 or int8 is asked and the first format's rows are whole blocks of four: one weight of
        two formats (PackedWeight.tail; forcing the 6-bit v onto int4 moved the 1.7B shape's logits 10x more than
        int8 does); otherwise such a layer is int8 as a whole.  None: quantize the dequantized values as `method`
        asks.  lib: the C kernels, which then also quantize what is re-quantized here (quantize.quantizer)."""
        kinds = [self.type_name(n) for n in names]
        table = _EXACT if lib is None else _EXACT_C
        fmts = [None if k == "Q6_K" and method not in ("int4", "int8") else table.get(k) for k in kinds]
        known = [f for f in fmts if f is not None]
        if len(known) == len(fmts):  # every part converts to a kernel format
            split = next((i for i, f in enumerate(known) if f != known[0]), len(known))
            if split == len(known):
                return self._convert(names, known[0], lib)
            first_rows = sum(self.shape(n)[0] for n in names[:split])
            if method in ("int4", "int8") and len(set(known[split:])) == 1 and first_rows % 4 == 0:
                first = self._convert(names[:split], known[0], lib)
                rest = self._convert(names[split:], known[split], lib)
                first.tail, first.n = rest, first.n + rest.n
                return first
        if lib is not None and method in ("int4", "int8") and all(k in _C_INT8 or _EXACT.get(k) == "int8"
                                                                  for k in kinds):
            return self._convert(names, "int8", lib)  # (5-8-bit parts in three runs: a Q5_K_M file's Q8_0 / Q5_K / Q6_K)
        formats = {_EXACT.get(k) for k in kinds}
        if len(formats) != 1 or None in formats:  # not every part converts directly, or not to one format
            wide = [k in _WIDER or _EXACT.get(k) == "int8" for k in kinds]
            if method != "int4" or not any(wide):
                return None
            split = wide.index(True)
            if split and all(wide[split:]) and sum(self.shape(n)[0] for n in names[:split]) % 4 == 0:
                head = self.packed(names[:split], "int4", lib)  # exact int4 parts first, the wider ones after
                tail = self.packed(names[split:], "int4", lib)  # int8: exact, or re-rounded from 5-8 bits
                if head is not None and head.wt in (WT_Q4, WT_Q5) and head.tail is None and tail is not None:
                    head.tail, head.n = tail, head.n + tail.n
                    return head
            from tokenspout.models.quantize import quantize_rows, quantizer

            return quantize_rows([self.rows(n) for n in names], quantizer("int8", lib))
        fmt = formats.pop()
        assert fmt is not None  # (checked above)
        return self._convert(names, fmt, lib)

    def _blocks(self, name: str) -> tuple[Any, np.ndarray, np.ndarray | None]:
        """(tensor, its rows of blocks [rows, bytes] as the file holds them, HF's row order or None)"""
        t = self._tensor(name)
        rows = int(t.shape[1]) if len(t.shape) > 1 else 1
        order = self._unpermute(name, np.arange(rows)) if self._permuted(name) else None
        return t, np.asarray(t.data).reshape(rows, -1), order

    def _convert(self, names: list[str], fmt: str, lib) -> PackedWeight:
        """The tensors `names` (rows stacked) in the kernels' `fmt`: each part's blocks converted (Q5_K / Q6_K to
        int8: re-fitted) and, with the C kernels, written at its row offset straight into the packed weight."""
        k = self.shape(names[0])[1]
        if lib is None:
            assert fmt not in ("int5", "int6")  # (only the C kernels write them)
            parts = []
            for n in names:
                t, raw, order = self._blocks(n)
                parts.append(_blocks_of(t.tensor_type.name, raw if order is None else raw[order]))
                self._release(t)
            q, d, m = (torch.cat(x) for x in zip(*parts))
            return pack_int8(q, d) if fmt == "int8" else pack_int4(q, d, m)
        pw = empty_packed(sum(self.shape(n)[0] for n in names), k, _WT[fmt])
        r0 = 0
        for n in names:
            t, raw, order = self._blocks(n)
            kind = t.tensor_type.name
            if fmt == "int6":
                r0 += q6k_into(lib, raw, order, k, r0, pw.codes, pw.scale)
            elif fmt == "int5":
                assert pw.min is not None
                r0 += q5_into(lib, kind, raw, order, k, r0, pw.codes, pw.scale, pw.min)
            elif kind == "Q4_K":
                assert pw.min is not None  # (an int4 weight's)
                r0 += q4k_into(lib, raw, order, k, r0, pw.codes, pw.scale, pw.min)
            elif kind in _C_INT8:
                r0 += k_int8_into(lib, kind, raw, order, k, r0, pw.codes, pw.scale)
            elif kind == "Q8_0" and fmt == "int8" or kind in ("Q4_0", "Q4_1") and fmt == "int4":
                r0 += blocks_into(lib, kind, raw, order, k, r0, pw.codes, pw.scale, pw.min)
            else:
                q, d, m = _blocks_of(kind, raw if order is None else raw[order])
                pack_into(lib, q, d, m if fmt == "int4" else None, r0, pw.codes, pw.scale, pw.min)
                r0 += q.shape[0]
            self._release(t)
        return pw


class _Rows:
    """Rows of one GGUF tensor, dequantized as they are sliced ([r0:r1] -> float32 [r1 - r0, K], Q/K un-permuted) or
    taken by index in the file's order (take)."""

    def __init__(self, ck: GGUFCheckpoint, name: str):
        self.ck, self.t = ck, ck._tensor(name)
        self.shape = ck.shape(name)
        self.raw = np.asarray(self.t.data).reshape(self.shape[0], -1)
        self.order = ck._unpermute(name, np.arange(self.shape[0]))  # HF row i is the file's row order[i]

    def take(self, idx: np.ndarray) -> torch.Tensor:
        """float32 [len(idx), K]: the file's rows idx, dequantized."""
        from gguf.quants import dequantize

        if self.t.tensor_type.name == "Q6_K" and len(idx) >= 64:  # (a few rows: numpy's fixed cost is lower)
            return q6k_rows(self.raw[idx])
        out = np.asarray(dequantize(self.raw[idx], self.t.tensor_type), dtype=np.float32)
        return torch.from_numpy(out.reshape(len(idx), self.shape[1]))

    def __getitem__(self, rows: slice) -> torch.Tensor:
        r0, r1, _ = rows.indices(self.shape[0])
        out = self.take(self.order[r0:r1])
        if r1 == self.shape[0]:
            self.ck._release(self.t)
        return out


class GGUFEmbedding(torch.nn.Module):
    """The token embedding kept as the file holds it (memory-mapped rows of GGUF blocks), each looked-up row
    dequantized when it is needed: the same float32 values as the whole table dequantized at load, without holding
    that table (a Llama-8B shape's 49k x 4096 float32 embedding is 0.8 GB; its Q4_K rows are 0.11 GB of the file,
    paged in only for the tokens used).  Used where the kernels compute the linear layers (quant_load)."""

    def __init__(self, gguf: Path, dtype: torch.dtype):
        super().__init__()
        self.table = GGUFCheckpoint(gguf).rows("embed_tokens.weight")  # (rows of a view of the map)
        if len(self.table.shape) != 2:  # (the loader has checked it against the config: loader.check_shapes)
            raise ValueError(f"{gguf.name}: token_embd.weight has shape {self.table.shape}, expected 2 dimensions")
        self.vocab, self.hidden = self.table.shape
        self.qtype, self.dtype = self.table.t.tensor_type, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.take(ids.reshape(-1).cpu().numpy()).to(self.dtype).reshape(*ids.shape, self.hidden)

    def extra_repr(self) -> str:
        return f"{self.vocab}, {self.hidden}, {self.qtype.name} rows of the file"


def _q4k_blocks(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K super-blocks (256 weights: float16 d and dmin, twelve bytes of 6-bit sub-block scales and mins, 128
    bytes of 4-bit codes) -> the kernels' int4 terms per group of 32: W = (d * sc) * q - dmin * m, so scale =
    d * sc and min = -dmin * m, rounded to float16 (the only difference from the file's values: a relative
    2^-11 at most on each group's scale and min; the codes are the file's)."""
    rows = raw.shape[0]
    b = np.ascontiguousarray(raw).reshape(rows, -1, 144)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)[..., None]  # [rows, S, 1]
    dmin = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)[..., None]
    sc = b[..., 4:16].astype(np.uint8)  # [rows, S, 12]
    lo6 = np.concatenate([sc[..., 0:4] & 63, (sc[..., 8:12] & 15) | ((sc[..., 0:4] >> 6) << 4)], -1)  # scales j<8
    mn6 = np.concatenate([sc[..., 4:8] & 63, (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)], -1)  # mins
    qs = b[..., 16:].reshape(rows, -1, 4, 32)  # 4 chunks of 64 weights: low nibbles sub-block 2j, high 2j+1
    q = np.stack([qs & 15, qs >> 4], 3).reshape(rows, -1, 8, 32)  # [rows, S, 8 sub-blocks, 32]
    scale = (d * lo6.astype(np.float32)).reshape(rows, -1)
    mins = (-dmin * mn6.astype(np.float32)).reshape(rows, -1)
    return (torch.from_numpy(q.reshape(rows, -1, 32).astype(np.uint8)), torch.from_numpy(scale).half(),
            torch.from_numpy(mins).half())


def q6k_rows(raw: np.ndarray) -> torch.Tensor:
    """Rows of Q6_K super-blocks (256 weights: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 sub-block
    scales, a float16 d) -> float32 rows, W = (d * scale) * (q - 32): the gguf package's dequantization step for
    step (bit-identical, tested) in torch, ~2x faster (rows read by quantize_rows or the embedding where the C
    kernels do not convert them: ts_q6k_to_q8 computes the same values)."""
    rows = raw.shape[0]
    b = torch.from_numpy(np.ascontiguousarray(raw)).view(-1, 210)
    n = b.shape[0]
    d = b[:, 208:210].contiguous().view(torch.float16).float()  # [n, 1]
    scale = (d * b[:, 192:208].view(torch.int8).float()).view(n, 16, 1)
    lo = (b[:, :128].reshape(n, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)) & 15
    hi = (b[:, 128:192].reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 3
    q = (lo.reshape(n, 8, 32) | (hi.reshape(n, 8, 32) << 4)).view(torch.int8) - 32
    return (scale * q.view(n, 16, 16).float()).view(rows, -1)


def _blocks_of(kind: str, raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of GGUF blocks [rows, G * block bytes] -> (codes [rows, G, 32], scale [rows, G] float16, min [rows, G]
    float16) in the kernels' terms: W = scale * q (+ min)."""
    if kind == "Q4_K":
        return _q4k_blocks(raw)
    size = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q8_0": 34}[kind]
    rows = raw.shape[0]
    b = np.ascontiguousarray(raw).reshape(rows, -1, size)
    d = torch.from_numpy(np.ascontiguousarray(b[..., :2]).view(np.float16)[..., 0].copy())
    if kind == "Q8_0":
        q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).copy())
        return q, d, torch.zeros_like(d)
    if kind == "Q5_0":  # W = d * (q - 16), q 5-bit: low nibbles in qs, the fifth bits in the 32-bit qh
        qh = np.ascontiguousarray(b[..., 2:6]).view(np.uint32)[..., 0][..., None]  # [rows, G, 1]
        bits = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4  # bit j -> element j
        qs = b[..., 6:]
        q5 = np.concatenate([qs & 15, qs >> 4], -1) | bits
        return torch.from_numpy(q5.astype(np.int8) - 16), d, torch.zeros_like(d)
    if kind == "Q4_1":
        m = torch.from_numpy(np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0].copy())
        nib = b[..., 4:]
    else:  # Q4_0: W = d * (q - 8)
        m = (d.float() * -8).half()
        nib = b[..., 2:]
    nib_t = torch.from_numpy(np.ascontiguousarray(nib))  # [rows, G, 16]: byte j = element j (low), j + 16 (high)
    q = torch.cat([nib_t & 15, nib_t >> 4], -1)  # [rows, G, 32]
    assert q.shape[-1] == GROUP
    return q, d, m
