"""Weight-only quantization for the decode kernels (`--quantization int8 | int4`), in groups of 32 along K.

* int8: symmetric, W = scale * q with q in [-127, 127] and one float16 scale per 32 weights (llama.cpp's Q8_0).
* int4: asymmetric, W = scale * q + min with q in [0, 15] and float16 scale and min per 32 weights (llama.cpp's
  Q4_1), for the decoder layers;
  the LM head stays int8 (it decides every token, and is 20% of the weight bytes of a small model).
`--quantization bf16 | fp16` are not quantizations but the same machinery for 16-bit float weights: each linear
layer holds its weight as bfloat16 / float16 [N, K] (what a bf16 / fp16 checkpoint holds, so lossless there; half
the bytes of float32), and the kernels widen it to float32 in registers (float32 activations and sums).

The int formats are those of the default model's GGUF (its layers are Q4_1, its tied embedding Q8_0), so on the default
model int4 reproduces the original weights and int8 the original LM head: the quantization there is lossless up to
float32 rounding.  On other models they are the usual lossy formats (quality checks in tests/parity).

Where the C kernels run, the torch model's linear layers become QuantLinear modules (models/quant_linear.py) that
hold only the packed codes (1.0625 or 0.625 bytes per weight instead of 4) and compute through the kernels;
elsewhere its weights are replaced by the dequantized values, so the torch path computes with the same effective
weights.  The token embedding stays exact (a lookup costs no weight bandwidth); a tied LM head is untied for that
reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from tokenspout.kernels.cpu import WT_BF16, WT_F16, WT_Q4, WT_Q5, WT_Q6, WT_Q8, pack_into, quantize_q4, quantize_q8
from tokenspout.models.llama import LlamaForCausalLM

QUANTIZATIONS = ("int8", "int4", "bf16", "fp16")
GROUP = 32
HALF_FORMATS = {"bf16": (torch.bfloat16, WT_BF16), "fp16": (torch.float16, WT_F16)}  # 16-bit float weights


@dataclass(slots=True)
class PackedWeight:
    """16-bit float weights (wt WT_BF16 / WT_F16): codes is the [N, K] bfloat16 / float16 weight, scale is empty.
    Quantized weights: codes and group parameters in the kernels' layout: per block of four output rows (N padded with zero rows),
    per group of 32 columns, the four rows' codes contiguous ([N/4][K/32][4][32 bytes] int8); int4 per pair of
    groups ([N/4][K/64 rounded up][4][32 bytes]: 16-bit word j of a row's 32 bytes holds the codes of the pair's
    columns j, 16+j, 32+j, 48+j in its nibbles, low to high; an odd last group leaves the upper two nibbles zero);
    scale/min [N/4][K/32][4] float16.
    int5 (WT_Q5: a GGUF file's Q5_0 / Q5_1 / Q5_K, W = scale * q + min, q 0..31, scale / min as int4's) per triple
    of groups ([N/4][K/96 rounded up][4][64 bytes]): 16-bit word j of half h of a row's 64 bytes holds the codes of
    the triple's columns 48h + j, 48h + 16 + j, 48h + 32 + j in bits 0-4, 5-9, 10-14; a short last triple's missing
    codes are zero.
    int6 (WT_Q6: a GGUF file's Q6_K, its values exactly: W = scale * sub * (q - 32), q 0..63, sub an int8 per 16
    columns, scale Q6_K's d repeated for each group; no min) per pair of groups ([N/4][K/64][208 bytes]): row r's
    48 bytes at 48 r, 32 of low nibbles (byte t: columns t, 32 + t, low nibble first) and 16 whose byte t holds the
    high two bits of columns t, 16 + t, 32 + t, 48 + t (bits 0-1, 2-3, 4-5, 6-7), then the sixteen sub-scales, that
    of row r's columns 16i..16i+15 at byte 192 + 4i + r (csrc/decode_cpu.c, q6_load)."""

    codes: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None
    n: int  # every row, the tail's included
    k: int
    wt: int
    # a fused weight of two quantized formats: codes / scale / min hold rows [0, n - tail.n) (a multiple of 4),
    # `tail` the last tail.n rows (a GGUF file's Q4_K q / k as int4, its Q6_K v as int6)
    tail: PackedWeight | None = None
    # the kernels round the activations to int8 for this weight (ModelConfig.activation_quant; set after loading, not
    # part of the quantized-weights cache)
    act8: bool = False

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the weight holds (its tail's included): what must stay alive while the kernels read it."""
        own = [t for t in (self.codes, self.scale, self.min) if t is not None]
        return own + (self.tail.tensors() if self.tail is not None else [])


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """[N, G, ...] -> [ceil(N/4), G, 4, ...] contiguous, zero-padded rows."""
    pad = -t.shape[0] % 4
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.view(-1, 4, *t.shape[1:]).transpose(1, 2).contiguous()


def empty_packed(n: int, k: int, wt: int) -> PackedWeight:
    """An int8 / int4 / int5 / int6 weight of n x k to be written row by row (kernels.cpu.pack_into and the GGUF
    converters: any rows, at any offset): uninitialised but for the padding rows of its last block of four, which are
    zero."""
    nb, groups = -(-n // 4), k // GROUP
    if wt == WT_Q6 and groups % 2:
        raise ValueError(f"int6 needs K a multiple of 64, got {k}")
    per = {WT_Q8: (groups, 4, 32), WT_Q4: (-(-groups // 2), 4, 32), WT_Q5: (-(-groups // 3), 4, 64),
           WT_Q6: (groups // 2, 1, 208)}[wt]
    codes = torch.empty(nb, *per, dtype=torch.int8 if wt == WT_Q8 else torch.uint8)
    if wt == WT_Q6 and n % 4:  # (the rows of a block share its 208 bytes: the whole last block zeroed)
        codes[-1] = 0
    scale = torch.empty(nb, groups, 4, dtype=torch.float16)
    mins = torch.empty(nb, groups, 4, dtype=torch.float16) if wt in (WT_Q4, WT_Q5) else None
    for t in (codes, scale, mins):
        if t is not None and n % 4 and not (t is codes and wt == WT_Q6):
            t[-1, :, n % 4 :] = 0
    return PackedWeight(codes.view(-1), scale.view(-1), None if mins is None else mins.view(-1), n, k, wt)


def quantize_int8(w: torch.Tensor) -> tuple[PackedWeight, torch.Tensor]:
    """(packed weight, dequantized float32 [N, K])."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    scale = (g.abs().amax(-1) / 127.0).half().float()  # [N, G], float16 like Q8_0 (and the kernels)
    q = torch.where(scale[..., None] > 0, torch.round(g / scale[..., None].clamp_min(1e-30)), 0).clamp_(-127, 127)
    deq = (q * scale[..., None]).view(n, k)
    return pack_int8(q.to(torch.int8), scale.half()), deq


def pack_int8(q: torch.Tensor, scale: torch.Tensor, lib=None) -> PackedWeight:
    """Codes q [N, K/32, 32] int8 and scales [N, K/32] float16 (Q8_0's blocks) -> the kernels' layout (by the C
    kernels `lib` where given: the same bytes, ~10x faster)."""
    n, groups = scale.shape
    if lib is not None:
        pw = empty_packed(n, groups * GROUP, WT_Q8)
        pack_into(lib, q, scale, None, 0, pw.codes, pw.scale, None)
        return pw
    return PackedWeight(_blocks(q).view(-1), _blocks(scale).view(-1), None, n, groups * GROUP, WT_Q8)


def quantize_int4(w: torch.Tensor) -> tuple[PackedWeight, torch.Tensor]:
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    lo = g.amin(-1).half().float()  # float16 like Q4_1 (and the kernels); codes are fitted to the rounded values
    scale = ((g.amax(-1) - lo) / 15.0).half().float()
    q = torch.where(scale[..., None] > 0, torch.round((g - lo[..., None]) / scale[..., None].clamp_min(1e-30)), 0)
    q = q.clamp_(0, 15)
    deq = (q * scale[..., None] + lo[..., None]).view(n, k)
    return pack_int4(q.to(torch.uint8), scale.half(), lo.half()), deq


def pack_int4(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, lib=None) -> PackedWeight:
    """Codes q [N, K/32, 32] uint8 in 0..15, scales and mins [N, K/32] float16 (Q4_1's blocks: W = scale * q + min)
    -> the kernels' layout (by the C kernels `lib` where given)."""
    n, groups = scale.shape
    if lib is not None:
        pw = empty_packed(n, groups * GROUP, WT_Q4)
        pack_into(lib, q, scale, lo, 0, pw.codes, pw.scale, pw.min)
        return pw
    if groups % 2:
        q = torch.cat([q, q.new_zeros(n, 1, GROUP)], 1)
    qb = q.view(n, -1, 4, 16)  # [N, pairs, quarter, j]: column 16 * quarter + j of the pair
    low, high = qb[:, :, 0] | (qb[:, :, 1] << 4), qb[:, :, 2] | (qb[:, :, 3] << 4)  # the bytes of word j (LE)
    nibbles = torch.stack([low, high], -1).view(n, -1, 32)  # [N, pairs, 32 bytes]
    return PackedWeight(_blocks(nibbles).view(-1), _blocks(scale).view(-1), _blocks(lo).view(-1), n,
                        groups * GROUP, WT_Q4)


def pack_int5(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, lib=None) -> PackedWeight:
    """Codes q [N, K/32, 32] uint8 in 0..31, scales and mins [N, K/32] float16 (Q5_1's terms: W = scale * q + min)
    -> the kernels' int5 layout (by the C kernels `lib` where given)."""
    n, groups = scale.shape
    if lib is not None:
        pw = empty_packed(n, groups * GROUP, WT_Q5)
        pack_into(lib, q, scale, lo, 0, pw.codes, pw.scale, pw.min, int5=True)
        return pw
    triples = -(-groups // 3)
    if groups % 3:
        q = torch.cat([q, q.new_zeros(n, triples * 3 - groups, GROUP)], 1)
    c = q.to(torch.int32).view(n, triples, 2, 3, 16)  # [N, triple, half h, third s, j]: column 48h + 16s + j
    words = c[:, :, :, 0] | (c[:, :, :, 1] << 5) | (c[:, :, :, 2] << 10)  # [N, triple, h, j]
    rows = torch.stack([words & 255, words >> 8], -1).to(torch.uint8).view(n, triples, 64)
    return PackedWeight(_blocks(rows).view(-1), _blocks(scale).view(-1), _blocks(lo).view(-1), n, groups * GROUP, WT_Q5)


def _half(fmt: str):
    dtype, wt = HALF_FORMATS[fmt]

    def to_half(w: torch.Tensor) -> tuple[PackedWeight, torch.Tensor]:
        """(the weight as a 16-bit float PackedWeight, its float32 values)."""
        h = w.to(dtype).contiguous()
        if not torch.isfinite(h).all():
            raise ValueError(f"weights overflow {fmt} (|w| up to {w.abs().max().item():.3g}): use bf16 or none")
        return PackedWeight(h, torch.empty(0, dtype=torch.float16), None, w.shape[0], w.shape[1], wt), h.float()

    return to_half


QUANTIZERS = {"int4": quantize_int4, "int8": quantize_int8, "bf16": _half("bf16"), "fp16": _half("fp16")}


def quantizer(fmt: str, lib=None):
    """QUANTIZERS[fmt], computed by the C kernels where `lib` is given (kernels/csrc/quant_cpu.c: the same codes,
    scales and minimums bit for bit, ~40x faster: a 1024 x 8192 chunk in ~3 ms instead of ~0.1-0.15 s); the C
    version returns no dequantized copy (None), which only the torch path's quantize_model uses."""
    if lib is None or fmt not in ("int8", "int4"):
        return QUANTIZERS[fmt]

    def fast(w: torch.Tensor) -> tuple[PackedWeight, None]:
        if fmt == "int8":
            return pack_int8(*quantize_q8(lib, w), lib=lib), None
        return pack_int4(*quantize_q4(lib, w), lib=lib), None

    return fast


def linear_format(name: str, method: str) -> str:
    """The kernels' format of linear layer `name` under `--quantization method`: int4 keeps the LM head int8; the
    16-bit float formats hold every layer, the LM head too."""
    if method in HALF_FORMATS:
        return method
    return "int4" if method == "int4" and name != "lm_head" else "int8"


def check_quantizable(name: str, in_features: int, method: str = "int4") -> None:
    step = 8 if method in HALF_FORMATS else GROUP  # the kernels' vector width / the quantization group
    if in_features % step:
        raise ValueError(f"{name}: in_features {in_features} is not a multiple of {step}, which --quantization "
                         f"{method} needs")


class RowSource(Protocol):
    """What quantize_rows reads: a 2-D shape and float rows by slice (a tensor, or a GGUF tensor's _Rows)."""

    @property
    def shape(self) -> Sequence[int]: ...

    def __getitem__(self, rows: slice, /) -> torch.Tensor: ...


def quantize_rows(parts: Sequence[RowSource], fn, dtype: torch.dtype = torch.float32, chunk: int = 1024) -> PackedWeight:
    """`fn` (quantize_int4 / quantize_int8, or quantizer()'s) over the row-wise concatenation of `parts`, `chunk` rows (a multiple of
    4: whole blocks) at a time, so the float temporaries are a chunk's, not the matrix's (and where a part makes its
    rows on demand, a GGUF tensor's, not even the part's).  Rows are rounded to
    `dtype` first, as the model's own weights would be; the result equals `fn` of the whole matrix."""
    assert chunk % 4 == 0
    n, k = sum(p.shape[0] for p in parts), parts[0].shape[1]
    pieces: list[PackedWeight] = []
    i, off = 0, 0  # the part and row where the next chunk starts
    for r0 in range(0, n, chunk):
        need, rows = min(chunk, n - r0), []
        while need:
            take = min(need, parts[i].shape[0] - off)
            rows.append(parts[i][off : off + take])
            off, need = off + take, need - take
            if off == parts[i].shape[0]:
                i, off = i + 1, 0
        w = torch.cat(rows) if len(rows) > 1 else rows[0]
        # bfloat16 rows in a float32 or bfloat16 model are what rounding them to the model dtype gives: every
        # quantizer takes them as they are (the C ones read bfloat16 directly, with no float32 copy of the chunk)
        exact = w.dtype == torch.bfloat16 and dtype in (torch.float32, torch.bfloat16)
        pieces.append(fn(w if exact else w.to(dtype).float())[0])
    first = pieces[0]
    mins = None if first.min is None else torch.cat([p.min for p in pieces if p.min is not None])
    return PackedWeight(torch.cat([p.codes for p in pieces]), torch.cat([p.scale for p in pieces]), mins, n, k,
                        first.wt)


def dequantize(pw: PackedWeight) -> torch.Tensor:
    """The float32 [N, K] values a PackedWeight encodes (the inverse of the packing)."""
    if pw.tail is not None:
        return torch.cat([dequantize(dataclasses.replace(pw, n=pw.n - pw.tail.n, tail=None)), dequantize(pw.tail)])
    if pw.wt in (WT_BF16, WT_F16):
        return pw.codes.float()
    n4, groups = -(-pw.n // 4) * 4, pw.k // GROUP
    scale = pw.scale.float().view(n4 // 4, groups, 4).transpose(1, 2).reshape(n4, groups)
    if pw.wt == WT_Q8:
        q = pw.codes.view(torch.int8).view(n4 // 4, groups, 4, GROUP).transpose(1, 2).reshape(n4, groups, GROUP)
        return (q.float() * scale[..., None]).reshape(n4, pw.k)[: pw.n]
    if pw.wt == WT_Q6:
        blk = pw.codes.view(torch.uint8).view(n4 // 4, groups // 2, 208)
        b = blk[..., :192].reshape(n4 // 4, groups // 2, 4, 48).transpose(1, 2)
        b = b.reshape(n4, groups // 2, 48).to(torch.int32)  # [N, pair, 48]: row r's nibbles and high bits
        lo4 = torch.cat([b[..., :32] & 15, b[..., :32] >> 4], -1).view(*b.shape[:-1], 4, 16)  # [N, pair, quarter, j]
        hi2 = torch.stack([(b[..., 32:48] >> (2 * i)) & 3 for i in range(4)], -2)
        sub = blk[..., 192:].view(torch.int8).view(n4 // 4, groups // 2, 4, 4).permute(0, 3, 1, 2)  # [blk, r, pair, i]
        sub = sub.reshape(n4, groups // 2, 4).to(torch.int32)
        w = sub[..., None] * ((lo4 | (hi2 << 4)) - 32)  # exact integers, |w| <= 4096
        return (w.reshape(n4, groups, GROUP).double() * scale[..., None].double()).float().reshape(n4, pw.k)[: pw.n]
    assert pw.min is not None
    lo = pw.min.float().view(n4 // 4, groups, 4).transpose(1, 2).reshape(n4, groups)
    if pw.wt == WT_Q5:
        triples = -(-groups // 3)
        b = pw.codes.view(n4 // 4, triples, 4, 32, 2).transpose(1, 2).reshape(n4, triples, 2, 16, 2).to(torch.int32)
        words = (b[..., 0] | (b[..., 1] << 8))[:, :, :, None, :]  # [N, triple, h, 1, j]
        q = ((words >> torch.tensor([0, 5, 10]).view(1, 1, 1, 3, 1)) & 31).reshape(n4, triples * 96)[:, : pw.k]
    else:
        pairs = -(-groups // 2)
        raw = pw.codes.view(torch.uint8).view(n4 // 4, pairs, 4, 16, 2).transpose(1, 2).reshape(n4, pairs, 16, 2)
        low, high = raw[..., 0], raw[..., 1]  # the bytes of word j: nibbles of columns j, 16+j | 32+j, 48+j
        q = torch.stack([low & 15, low >> 4, high & 15, high >> 4], 2).reshape(n4, pairs * 64)[:, : pw.k]
    return (q.float().view(n4, groups, GROUP) * scale[..., None] + lo[..., None]).reshape(n4, pw.k)[: pw.n]


@torch.no_grad()
def quantize_model(model: LlamaForCausalLM, method: str) -> dict[str, PackedWeight]:
    """Quantizes a loaded float model in place for a CPU the kernels do not run on: its weights become their
    dequantized values (the torch model computes with them); returns the packed weights by module name
    ("layers.i.self_attn.qkv_proj", ..., "lm_head").  Where the kernels run, models/quant_load.py builds the model
    with QuantLinear layers straight from the checkpoint instead."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
    out: dict[str, PackedWeight] = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        check_quantizable(name, module.weight.shape[1], method)
        packed, deq = QUANTIZERS[linear_format(name, method)](module.weight)
        out[name] = packed
        deq = deq.to(module.weight.dtype)
        if name == "lm_head" and module.weight is model.embed_tokens.weight:
            module.weight = nn.Parameter(deq, requires_grad=False)  # untie: the embedding stays exact
        else:
            module.weight.copy_(deq)
    return out
