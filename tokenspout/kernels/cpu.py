"""Builds (once per machine and ISA level, cached by source hash) and loads the kernels in csrc/: the decode stack
(decode_cpu.c), the one-call sampler of random rows (sample_cpu.c) and the weight quantization / GGUF conversion of
a first start (quant_cpu.c).

ISA levels (`ISA_LEVELS`), one build of the same sources each, picked at run time from the CPU's flags:
* `avx2`: AVX2 + FMA + F16C (every kernel);
* `avx512`: adds AVX-512 F/BW/VL + VNNI: the quantized linears (row and tiled paths) use 512-bit vectors and
  vpdpwssd (-DTS_AVX512=1 selects them in decode_cpu.c); everything else is the AVX2 code, compiled for the wider ISA.
The best level the CPU has is used unless TOKENSPOUT_ISA=avx2|avx512 forces one (tests force each level the
machine has, so every level stays tested where it can run).

`load_emulated(isa)` builds a level this CPU lacks from the same sources on SIMDe's portable intrinsics (csrc/isa.h,
the `simde-py` package of the tests): the AVX-512 code then runs, slowly, on an AVX2 CPU, so the tests check its
results on every machine (the engine never loads it).

`load(invariant=True)` is the batch-invariant build (`--batch-invariant`): the AVX2 level compiled with
-DTS_BATCH_INVARIANT=1, where every batch size computes a row's outputs in one summation order (decode_cpu.c, "the
row path"), on any CPU with AVX2 (AVX-512 ones too: the AVX-512 kernels keep their own orders).

The library is plain C called through ctypes, compiled with the system gcc (no torch headers), each source by its
own gcc side by side (~6 s on the 2-core AVX2 EPYC where one call for all of them took ~10 s): once per machine,
ISA level and source version; a warm start only dlopens it.  `load()` returns None, and the model
keeps its torch path, when the CPU lacks AVX2/FMA, no C compiler is found, the build fails, or
TOKENSPOUT_KERNELS=0 is set.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # loads torch's libgomp first, so the kernels share its OpenMP runtime

from tokenspout.platform import cpu_flags

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "decode_cpu.c", CSRC / "sample_cpu.c", CSRC / "quant_cpu.c")
HEADERS = (CSRC / "simd.h", CSRC / "isa.h")
# the kernels' weight types (ts_weight.wt in decode_cpu.c)
WT_F32, WT_Q8, WT_Q4, WT_BF16, WT_F16, WT_Q5, WT_Q6 = 0, 1, 2, 3, 4, 5, 6
# float weights the kernels read as they are (16-bit ones widened to float32 in registers): torch dtype -> C type
FLOAT_WEIGHT_TYPES = {torch.float32: WT_F32, torch.bfloat16: WT_BF16, torch.float16: WT_F16}

i64, f32, vp = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class Weight(ctypes.Structure):
    pass


# tail: a second Weight for rows [n_head, N) in another quantized format (csrc ts_weight); NULL for one format
# act8: int8 activations (csrc ts_weight.act8; PackedWeight.act8)
Weight._fields_ = [("w", vp), ("scale", vp), ("min", vp), ("wt", i64), ("tail", ctypes.POINTER(Weight)),
                   ("n_head", i64), ("act8", i64)]


class Layer(ctypes.Structure):
    _fields_ = [("ln1", vp), ("ln2", vp), ("qkv", Weight), ("o", Weight), ("gate_up", Weight), ("down", Weight),
                ("qkv_bias", vp), ("kv", vp), ("q_norm", vp), ("k_norm", vp)]


class Model(ctypes.Structure):
    _fields_ = [("num_layers", i64), ("hidden", i64), ("inter", i64), ("H", i64), ("Hkv", i64), ("D", i64),
                ("slots", i64), ("block_size", i64), ("eps", f32), ("scale", f32),
                ("layers", ctypes.POINTER(Layer)), ("cos", vp), ("sin", vp), ("kv_half", i64)]


def cache_dir() -> Path:
    return Path(os.environ.get("TOKENSPOUT_CACHE", Path.home() / ".cache" / "tokenspout")) / "kernels"


# level -> (CPU flags it needs, as /proc/cpuinfo names them; compiler flags), weakest first
ISA_LEVELS: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {
    "avx2": (frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c")),
    "avx512": (frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}),
               ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni",
                "-DTS_AVX512=1")),
}


def available_isas() -> list[str]:
    """The ISA levels this CPU runs, weakest first."""
    flags = cpu_flags()
    return [name for name, (need, _) in ISA_LEVELS.items() if need <= flags]


def chosen_isa() -> str | None:
    """TOKENSPOUT_ISA when set (an error if this CPU lacks it), else the best level the CPU has (None: none)."""
    forced = os.environ.get("TOKENSPOUT_ISA")
    have = available_isas()
    if forced:
        if forced not in ISA_LEVELS:
            raise ValueError(f"TOKENSPOUT_ISA must be one of {sorted(ISA_LEVELS)}, got {forced!r}")
        if forced not in have:
            missing = sorted(ISA_LEVELS[forced][0] - cpu_flags())
            raise ValueError(f"TOKENSPOUT_ISA={forced}: this CPU lacks {', '.join(missing)}")
        return forced
    return have[-1] if have else None


def _isa_flags(isa: str, emulated: bool) -> tuple[str, ...]:
    """The compiler flags of `isa`; emulated: its defines on AVX2's instructions, the intrinsics from SIMDe."""
    if not emulated:
        return ISA_LEVELS[isa][1]
    import simde_py  # (a test requirement: only the emulated builds need it)

    defines = tuple(f for f in ISA_LEVELS[isa][1] if f.startswith("-D"))
    # -Wno-psabi: SIMDe's 512-bit structs passed by value (one build, one ABI); -O2 without the RTL combiner: gcc
    # 12's combiner spends 250 s on decode_cpu.c's inlined emulation at -O1 / -O3 (14 s in all without it)
    return (*ISA_LEVELS["avx2"][1], *defines, "-DTS_SIMDE=1", f"-I{simde_py.get_include()}", "-Wno-psabi",
            "-O2", "-fdisable-rtl-combine")


def _build(out: Path, defines: tuple[str, ...] = (), isa: str = "avx2", emulated: bool = False,
           csrc: Path = CSRC) -> None:
    """Compiles the library for `isa` to `out`; `defines` (e.g. "TILE_MIN=1000000") are for benchmarks of variants;
    emulated: on SIMDe's intrinsics (load_emulated); csrc: a folder holding the sources and headers under the same
    names (bench.attention --against: another revision's)."""
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        so = Path(tmp) / out.name
        # (a call before its function's definition is an error, not an implicit int(...) declaration whose float
        # arguments would travel as doubles: gcc 12 only warns)
        flags = ["-O3", *_isa_flags(isa, emulated), "-fopenmp", "-fPIC", "-Werror=implicit-function-declaration",
                 *(f"-D{d}" for d in defines)]
        # each source compiled by its own gcc, side by side, then linked: 9.8 -> 6.0 s here (decode_cpu.c alone
        # takes most of it), which a fresh machine's first start and every source change pay
        sources = [csrc / src.name for src in SOURCES]
        objs = [Path(tmp) / f"{src.stem}.o" for src in sources]
        compiles = [[cc, *flags, "-c", "-o", str(obj), str(src)] for src, obj in zip(sources, objs)]
        procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for cmd in compiles]
        errors = [proc.communicate()[1] for proc in procs]  # (all of them waited for, failed or not)
        for cmd, proc, err in zip(compiles, procs, errors):
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
        link = [cc, "-shared", "-fopenmp", "-o", str(so), *map(str, objs)]
        res = subprocess.run(link, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(link)} failed:\n{res.stderr[-2000:]}")
        os.replace(so, out)  # atomic: concurrent builders each produce a complete file


def load(isa: str | None = None, invariant: bool = False) -> ctypes.CDLL | None:
    """The library for `isa` (default: `chosen_isa()`), or None where the kernels are off or cannot be built;
    invariant: the batch-invariant build (AVX2 only; `isa` must be None or "avx2")."""
    if os.environ.get("TOKENSPOUT_KERNELS", "1") == "0":
        return None
    if invariant:
        if isa not in (None, "avx2"):
            raise ValueError(f"the batch-invariant kernels are the AVX2 level's, not {isa!r}")
        if "avx2" not in available_isas():
            logger.info("CPU lacks AVX2/FMA/F16C: no batch-invariant kernels")
            return None
        return _load("avx2", invariant=True)
    picked = isa is None and not os.environ.get("TOKENSPOUT_ISA")
    isa = isa or chosen_isa()
    if isa is None:
        logger.info("CPU lacks AVX2/FMA/F16C: decode kernels off, torch path only")
        return None
    lib = _load(isa)
    if lib is None and picked and isa != "avx2":
        # a compiler too old for this level's flags: the next level down
        lower = available_isas()[available_isas().index(isa) - 1]
        logger.warning("CPU kernels: %s unavailable, trying %s", isa, lower)
        return load(lower)
    return lib


def emulated_isas() -> list[str]:
    """The ISA levels this CPU lacks that load_emulated can build (none without AVX2 or the simde-py package)."""
    have = available_isas()
    if "avx2" not in have or importlib.util.find_spec("simde_py") is None:
        return []
    return [isa for isa in ISA_LEVELS if isa not in have]


def load_emulated(isa: str) -> ctypes.CDLL | None:
    """`isa`'s kernels on SIMDe's portable intrinsics (for tests on a CPU without `isa`; see the module docstring);
    None where the kernels are off or the build fails."""
    if isa not in emulated_isas():
        raise ValueError(f"{isa!r} is not an ISA level to emulate here (emulated: {emulated_isas()})")
    if os.environ.get("TOKENSPOUT_KERNELS", "1") == "0":
        return None
    return _load(isa, emulated=True)


@functools.cache
def _load(isa: str, invariant: bool = False, emulated: bool = False) -> ctypes.CDLL | None:
    if isa not in (emulated_isas() if emulated else available_isas()):
        raise ValueError(f"ISA level {isa!r} is not available on this CPU (it has {available_isas()})")
    digest = hashlib.sha256(b"".join(src.read_bytes() for src in SOURCES + HEADERS)).hexdigest()[:16]
    variant = f"{isa}-invariant" if invariant else f"{isa}-emulated" if emulated else isa
    so = cache_dir() / f"decode_cpu-{variant}-{digest}.so"
    try:
        if not so.is_file():
            _build(so, defines=("TS_BATCH_INVARIANT=1",) if invariant else (), isa=isa, emulated=emulated)
        lib = ctypes.CDLL(str(so))
    except (OSError, RuntimeError) as e:
        logger.warning("decode kernels (%s) unavailable, using the torch path: %s", variant, e)
        return None
    logger.info("CPU kernels: %s", variant)
    lib.ts_linear.argtypes = [vp, i64, i64, ctypes.POINTER(Weight), vp, i64, i64, vp, i64, ctypes.c_int]
    lib.ts_linear.restype = None
    lib.ts_rmsnorm.argtypes = [vp, i64, i64, vp, f32, vp]
    lib.ts_rmsnorm.restype = None
    lib.ts_attn_decode.argtypes = [vp, i64, vp, i64, vp, i64, vp, i64, i64, i64, i64, i64, f32, vp, i64, i64]
    lib.ts_attn_decode.restype = None
    lib.ts_decode_layers.argtypes = [ctypes.POINTER(Model), vp, i64, vp, vp, vp, i64, vp, vp, vp,
                                     ctypes.POINTER(Weight), i64, vp]
    lib.ts_decode_layers.restype = None
    lib.ts_sample_rows.argtypes = [vp, i64, i64, vp, i64, vp, vp, vp, vp, vp, vp, i64, vp]
    lib.ts_sample_rows.restype = None
    lib.ts_argmax_rows.argtypes = [vp, i64, i64, i64, vp]
    lib.ts_argmax_rows.restype = None
    lib.ts_sample_rows_warped.argtypes = [vp, i64, i64, vp, i64, vp, vp, vp, vp, vp, vp, i64, vp, vp]
    lib.ts_sample_rows_warped.restype = None
    lib.ts_sample_rows_mirostat.argtypes = [vp, i64, i64, vp, i64, vp, vp, vp, i64, vp, vp, vp, vp]
    lib.ts_sample_rows_mirostat.restype = None
    lib.ts_quantize_q8.argtypes = [vp, i64, i64, ctypes.c_int, vp, vp]
    lib.ts_quantize_q8.restype = None
    lib.ts_quantize_q4.argtypes = [vp, i64, i64, ctypes.c_int, vp, vp, vp]
    lib.ts_quantize_q4.restype = None
    lib.ts_q4k_to_q4.argtypes = [vp, vp, i64, i64, i64, vp, vp, vp]
    lib.ts_q6k_to_q8.argtypes = [vp, vp, i64, i64, i64, vp, vp]
    lib.ts_q6k_to_q6.argtypes = [vp, vp, i64, i64, i64, vp, vp]
    lib.ts_q5k_to_q8.argtypes = [vp, vp, i64, i64, i64, vp, vp]
    lib.ts_pack_q8.argtypes = [vp, vp, i64, i64, i64, vp, vp]
    lib.ts_pack_q4.argtypes = [vp, vp, vp, i64, i64, i64, vp, vp, vp, i64]
    lib.ts_q5_to_q5.argtypes = [vp, vp, i64, i64, i64, i64, vp, vp, vp]
    lib.ts_q5k_to_q5.argtypes = [vp, vp, i64, i64, i64, vp, vp, vp]
    lib.ts_q8_0_to_q8.argtypes = [vp, vp, i64, i64, i64, vp, vp]
    lib.ts_q4_to_q4.argtypes = [vp, vp, i64, i64, i64, i64, vp, vp, vp]
    for f in (lib.ts_q4k_to_q4, lib.ts_q6k_to_q8, lib.ts_q6k_to_q6, lib.ts_q5k_to_q8, lib.ts_pack_q8, lib.ts_pack_q4,
              lib.ts_q5_to_q5, lib.ts_q5k_to_q5, lib.ts_q8_0_to_q8, lib.ts_q4_to_q4):
        f.restype = None
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def weight(w) -> tuple[Weight, int]:
    """(the C descriptor, N) of a float32 / bfloat16 / float16 [N, K] tensor or a models.quantize.PackedWeight."""
    if isinstance(w, torch.Tensor):
        assert w.dtype in FLOAT_WEIGHT_TYPES and w.is_contiguous() and w.dim() == 2
        return Weight(w.data_ptr(), None, None, FLOAT_WEIGHT_TYPES[w.dtype]), w.shape[0]
    desc = Weight(w.codes.data_ptr(), w.scale.data_ptr(), _ptr(w.min), w.wt, act8=int(w.act8))
    if w.tail is not None:
        tail, _ = weight(w.tail)
        desc.tail, desc.n_head = ctypes.pointer(tail), w.n - w.tail.n  # (the pointer object keeps `tail` alive)
    return desc, w.n


def linear(lib, x: torch.Tensor, w, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
           accumulate: bool = False) -> torch.Tensor:
    """x [M, K] float32 contiguous @ W^T (+ bias) -> out [M, N]; w as in `weight`."""
    m, k = x.shape
    desc, n = weight(w)
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    lib.ts_linear(x.data_ptr(), k, m, ctypes.byref(desc), _ptr(bias), n, k, out.data_ptr(), n, int(accumulate))
    return out


def _rows_in(w: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(w as the C quantizers read it: bfloat16 as it is, anything else float32; contiguous, whether bfloat16)"""
    bf16 = w.dtype == torch.bfloat16
    return (w if bf16 else w.float()).contiguous(), int(bf16)


def quantize_q8(lib, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (float32, or bfloat16 read as it is) -> (codes [N, K/32, 32] int8, scales [N, K/32] float16):
    models/quantize.py's quantize_int8 values, computed in C (csrc/quant_cpu.c)."""
    w, bf16 = _rows_in(w)
    n, k = w.shape
    q = torch.empty(n, k // 32, 32, dtype=torch.int8)
    scale = torch.empty(n, k // 32, dtype=torch.float16)
    lib.ts_quantize_q8(w.data_ptr(), n, k, bf16, q.data_ptr(), scale.data_ptr())
    return q, scale


def quantize_q4(lib, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (codes [N, K/32, 32] uint8 in 0..15, scales, minimums [N, K/32] float16): quantize_int4's
    values, computed in C."""
    w, bf16 = _rows_in(w)
    n, k = w.shape
    q = torch.empty(n, k // 32, 32, dtype=torch.uint8)
    scale = torch.empty(n, k // 32, dtype=torch.float16)
    lo = torch.empty(n, k // 32, dtype=torch.float16)
    lib.ts_quantize_q4(w.data_ptr(), n, k, bf16, q.data_ptr(), scale.data_ptr(), lo.data_ptr())
    return q, scale, lo

def _rows_arg(raw, order, size: int, k: int, r0: int, codes: torch.Tensor, wt: int, block: int = 256):
    """GGUF rows [rows, k / block * size] and their order, checked, for a C converter writing rows r0.. of a packed
    weight of format wt whose codes are `codes`: (the arrays the call reads, which the caller keeps alive, and the
    converter's leading arguments: rows, order or NULL, rows out, k, r0)."""
    import numpy as np

    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if k % block or raw.ndim != 2 or raw.shape[1] != k // block * size:
        raise ValueError(f"rows of {raw.shape[-1]} bytes are not {k} weights in blocks of {size} bytes")
    if order is not None:
        order = np.ascontiguousarray(order, dtype=np.int64)
        if order.size and (order.min() < 0 or order.max() >= raw.shape[0]):
            raise ValueError("row order out of range")
    n = raw.shape[0] if order is None else order.size
    _check_room(codes, r0, n, code_row_bytes(wt, k))
    return (raw, order), (raw.ctypes.data, None if order is None else order.ctypes.data, n, k, r0)


def _check_room(codes: torch.Tensor, r0: int, n: int, row_bytes: int) -> None:
    """The packed weight whose codes are `codes` (row_bytes a row) has rows r0..r0 + n: the C writers store into raw
    memory and must never pass its end."""
    if r0 < 0 or (r0 + n + 3) // 4 * 4 * row_bytes > codes.numel() * codes.element_size():
        raise ValueError(f"rows {r0}..{r0 + n} do not fit the packed weight")


def q4k_into(lib, raw, order, k: int, r0: int, codes: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor) -> int:
    """Q4_K super-blocks (numpy uint8 rows [R, k / 256 * 144]; output row i is raw row order[i], or i) -> rows r0..
    of a packed int4 weight of K = k (codes / scale / mins: its tensors, quantize.PackedWeight's layout), with
    gguf_model._q4k_blocks' values; in C (csrc/quant_cpu.c).  Returns the rows written."""
    _keep, args = _rows_arg(raw, order, 144, k, r0, codes, WT_Q4)
    lib.ts_q4k_to_q4(*args, codes.data_ptr(), scale.data_ptr(), mins.data_ptr())
    return args[2]


def k_int8_into(lib, kind: str, raw, order, k: int, r0: int, codes: torch.Tensor, scale: torch.Tensor) -> int:
    """Q6_K or Q5_K super-blocks (rows [R, k / 256 * 210 or 176]) -> rows r0.. of a packed int8 weight: the values
    the gguf package's dequantization gives (gguf_model.q6k_rows: its Q6_K steps), quantized as quantize_q8, in one
    pass in C.  Returns the rows written."""
    size, fn = {"Q6_K": (210, lib.ts_q6k_to_q8), "Q5_K": (176, lib.ts_q5k_to_q8)}[kind]
    _keep, args = _rows_arg(raw, order, size, k, r0, codes, WT_Q8)
    fn(*args, codes.data_ptr(), scale.data_ptr())
    return args[2]


def q6k_into(lib, raw, order, k: int, r0: int, codes: torch.Tensor, scale: torch.Tensor) -> int:
    """Q6_K super-blocks (rows [R, k / 256 * 210]) -> rows r0.. of a packed int6 weight (quantize.PackedWeight's
    layout) with the file's codes, sub-scales and d: its values exactly; in C.  Returns the rows written."""
    _keep, args = _rows_arg(raw, order, 210, k, r0, codes, WT_Q6)
    lib.ts_q6k_to_q6(*args, codes.data_ptr(), scale.data_ptr())
    return args[2]


def blocks_into(lib, kind: str, raw, order, k: int, r0: int, codes: torch.Tensor, scale: torch.Tensor,
                mins: torch.Tensor | None) -> int:
    """Q8_0 blocks (rows [R, k / 32 * 34]) -> rows r0.. of a packed int8 weight, Q4_0 / Q4_1 blocks (18 / 20 bytes)
    -> of a packed int4 weight (mins: its minimums), with the file's codes and float16 terms (Q4_0's min = -8 x
    its scale: gguf_model._blocks_of's values), in one C pass.  Returns the rows written."""
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]
    _keep, args = _rows_arg(raw, order, size, k, r0, codes, WT_Q8 if kind == "Q8_0" else WT_Q4, block=32)
    if kind == "Q8_0":
        lib.ts_q8_0_to_q8(*args, codes.data_ptr(), scale.data_ptr())
    else:
        assert mins is not None
        lib.ts_q4_to_q4(*args, int(kind == "Q4_1"), codes.data_ptr(), scale.data_ptr(), mins.data_ptr())
    return args[2]


def code_row_bytes(wt: int, k: int) -> int:
    """Bytes of a packed row's codes of K = k (quantize.PackedWeight): int8 one a weight, int4 32 per pair of groups
    of 32, int5 64 per triple, int6 52 per pair (k a multiple of 64)."""
    groups = k // 32
    if wt == WT_Q6 and groups % 2:
        raise ValueError(f"int6 needs K a multiple of 64, got {k}")
    return {WT_Q8: k, WT_Q4: -(-groups // 2) * 32, WT_Q5: -(-groups // 3) * 64, WT_Q6: groups // 2 * 52}[wt]


def q5_into(lib, kind: str, raw, order, k: int, r0: int, codes: torch.Tensor, scale: torch.Tensor,
            mins: torch.Tensor) -> int:
    """Q5_0 / Q5_1 blocks (rows [R, k / 32 * 22 or 24]) or Q5_K super-blocks (rows [R, k / 256 * 176]) -> rows r0..
    of a packed int5 weight (codes / scale / mins: its tensors) with the file's codes (Q5_0's min = -16 x its
    scale; Q5_K's scale and min per group rounded to float16, as Q4_K's); in C.  Returns the rows written."""
    size, block = (176, 256) if kind == "Q5_K" else ({"Q5_0": 22, "Q5_1": 24}[kind], 32)
    _keep, args = _rows_arg(raw, order, size, k, r0, codes, WT_Q5, block=block)
    outs = (codes.data_ptr(), scale.data_ptr(), mins.data_ptr())
    if kind == "Q5_K":
        lib.ts_q5k_to_q5(*args, *outs)
    else:
        lib.ts_q5_to_q5(*args, int(kind == "Q5_1"), *outs)
    return args[2]


def pack_into(lib, q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor | None, r0: int, codes: torch.Tensor,
              oscale: torch.Tensor, omin: torch.Tensor | None, int5: bool = False) -> None:
    """Codes [n, G, 32] (int8; or uint8 0..15 with minimums `lo`: int4; or 0..31 with `lo` and int5) and scales
    [n, G] float16 -> rows r0.. r0 + n of a packed weight (quantize.pack_int8 / pack_int4 / pack_int5's layout), in
    C."""
    n, groups = scale.shape
    assert q.shape == (n, groups, 32) and q.element_size() == 1 and scale.dtype == torch.float16
    q, scale = q.contiguous(), scale.contiguous()
    _check_room(codes, r0, n, code_row_bytes(WT_Q8 if lo is None else WT_Q5 if int5 else WT_Q4, groups * 32))
    if lo is None:
        lib.ts_pack_q8(q.data_ptr(), scale.data_ptr(), n, groups, r0, codes.data_ptr(), oscale.data_ptr())
    else:
        assert omin is not None
        lo = lo.contiguous()
        lib.ts_pack_q4(q.data_ptr(), scale.data_ptr(), lo.data_ptr(), n, groups, r0, codes.data_ptr(),
                       oscale.data_ptr(), omin.data_ptr(), int(int5))
