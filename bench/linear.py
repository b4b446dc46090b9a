"""Quantized linear kernels: the C library's row and tiled paths against torch's float32 GEMM (MKL), per batch size.

    python -m bench.linear             # M = 1, 4, 8, 16, 32, 64, 128; int4 layers + int8 LM head (~1 min)
    python -m bench.linear --threads 1
    python -m bench.linear --weights int8 --act8 --rows 1 16 32 64   # Q8_0-family layers, int8 activations too
    python -m bench.linear --layers smollm2-1.7b --rows 16 64 --against REV   # 1.7B-shaped layers, REV's kernels too

Every ISA level the CPU has gets its own `kernels` column (kernels_avx2, kernels_avx512: the same library built per
level, as TOKENSPOUT_ISA forces it).

One "pass" = the default model's linear shapes of one decoder layer (qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536, int4 = Q4_1) plus 1/30 of its LM head (49,152x576, int8 = Q8_0), so a pass is 1/30 of a decode
step's linear work.  Columns, measured in alternating rounds (median ms per pass):
* `kernels_<isa>`: tokenspout's library as shipped, built for that ISA level (row path below TILE_MIN = 16 rows,
  tiled path from there);
* `row`: the best level's library built with the tiled path off (-DTILE_MIN=1000000, and TILE_MIN6 / TILE_MIN8 /
  TILE_MIN8_Q8 / TILE_MIN5_A8 / TILE_MIN6_A8: int6 weights and int4 / int8 / int5 / int6 ones with int8
  activations tile earlier), to show what the tiled path buys;
* `torch`: F.linear on the dequantized float32 weights (what the torch model computes; MKL sgemm);
* with `--act8`, `kernels_<isa>_a8`: the same library and weights with int8 activations (`--activation-quant int8`:
  the byte tiles, vpmaddubsw with AVX2 for int4 / int5, vpdpbusd with AVX-512 for int4 / int5 / int8).
`--weights int8` makes the layers int8 (Q8_0) instead of int4 (Q4_1); `--weights int6` int6 (a GGUF file's Q6_K,
fitted by bench.common.q6k_int6 and converted as a file's is; the LM head int6 too, as a Q4_K_M file's is) and adds a
column `kernels_<isa>_as_int8`: the same values re-quantized to int8 (how tokenspout served Q6_K before int6), same
library and activations, so the two side by side measure int6's cost per weight (int6 needs `--layers
smollm2-1.7b`).  `--layers smollm2-1.7b`: one decoder layer of SmolLM2-1.7B's shape (qkv 6144x2048, o 2048x2048, gate_up 16384x2048, down 2048x8192) plus a 30th of its LM head,
with 4 weight copies (a layer is 30 MB of int4: 4 copies are past the L3).  `--against REV` adds a column
`kernels_REV`: git revision REV's kernels built for the best level (bench.common.library_at), same weights and
activations, for an A/B of a kernel change in one run.
Rounds rotate the order of the three (see `rotated`).  Below 16 rows `kernels` and `row` run the same code: their
ratio there (0.90-0.97x measured: the two builds differ only in code layout) is this benchmark's noise floor.
Weights are cycled through 24 copies (twice the L3) so each pass reads them from memory, as a real step does.  Results go to
bench/results/linear.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the engine process runs (set before torch loads libgomp)
import torch
import torch.nn.functional as F

from bench.common import built_library, library_at, q6k_int6, write_json
from tokenspout.kernels import cpu
from tokenspout.models.quantize import quantize_int4, quantize_int8

# per --layers: one decoder layer's linears, a 30th of the LM head per pass (one decode step = 30 passes), and the
# weight copies cycled (the default model: ~65 MB, twice this VM's 32 MB L3; the columns start copies apart)
LAYERS = {"smollm2-135m": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], (49152 // 30, 576), 24),
          "smollm2-1.7b": ([(6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192)], (49152 // 30, 2048), 4)}


def rotated(fns: dict[str, Callable[[], None]], budget_s: float = 1.0, min_rounds: int = 9) -> dict[str, float]:
    """Median ms per call, in rounds of one call each whose order rotates every round: the call right after torch's
    MKL GEMM measured 10-20% slow whichever it was, so each column takes each place equally often."""
    names = list(fns)
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in names}
    start, r = time.perf_counter(), 0
    while r < min_rounds or time.perf_counter() - start < budget_s:
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
        r += 1
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def int6_fit(w: torch.Tensor):
    """w fitted as Q6_K and converted to int6 as a GGUF file's Q6_K is: (packed weight, its values float32)."""
    packed, values, _ = q6k_int6(w, cpu.load())
    return packed, values


def one_pass(fn, xs: list[torch.Tensor], weights: list[list], start: int) -> Callable[[], None]:
    """A pass over every shape, each call on the next of the weight copies (from `start`)."""
    state = {"copy": start}
    n_copies = len(weights[0])

    def call() -> None:
        c = state["copy"] = (state["copy"] + 1) % n_copies
        for x, copies in zip(xs, weights, strict=True):
            fn(x, copies[c])

    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None, help="torch / OpenMP threads (default: torch's)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--weights", choices=["int4", "int8", "int6"], default="int4",
                    help="the layers' format (LM head: int8; int6: int6 too)")
    ap.add_argument("--act8", action="store_true", help="add a column per level with int8 activations")
    ap.add_argument("--layers", choices=list(LAYERS), default="smollm2-135m", help="whose layer shapes")
    ap.add_argument("--against", default=None, help="a git revision whose kernels to time beside today's")
    args = ap.parse_args()
    if args.weights == "int6" and args.layers != "smollm2-1.7b":
        ap.error("--weights int6 needs --layers smollm2-1.7b (Q6_K's super-blocks of 256 columns; 576 is not)")
    if args.threads:
        torch.set_num_threads(args.threads)
    if cpu.load() is None:
        raise SystemExit("the C kernels are unavailable on this machine")
    isas = cpu.available_isas()
    libs = {f"kernels_{isa}": cpu.load(isa) for isa in isas}
    best = f"kernels_{isas[-1]}"
    g = torch.Generator().manual_seed(0)
    layer_fn = {"int4": quantize_int4, "int8": quantize_int8, "int6": int6_fit}[args.weights]
    layer, lm_head, n_copies = LAYERS[args.layers]
    shapes = [(n, k, layer_fn) for n, k in layer] + [(*lm_head, int6_fit if args.weights == "int6" else quantize_int8)]
    weights = [[fn(torch.randn(n, k, generator=g) * 0.05) for _ in range(n_copies)] for n, k, fn in shapes]
    # [packed, values, the same codes flagged for int8 activations (--act8), the values as int8 (int6)]
    weights = [[(packed, deq, dataclasses.replace(packed, act8=True) if args.act8 else None,
                 quantize_int8(deq)[0] if args.weights == "int6" else None) for packed, deq in copies]
               for copies in weights]
    flops_per_row = sum(2 * n * k for n, k, _ in shapes)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        libs["row"] = built_library(Path(tmp) / "decode_cpu-row-only.so", isas[-1],
                                    ("TILE_MIN=1000000", "TILE_MIN6=1000000", "TILE_MIN8=1000000",
                                     "TILE_MIN8_Q8=1000000", "TILE_MIN5_A8=1000000", "TILE_MIN6_A8=1000000"))
        if args.against:
            libs[f"kernels_{args.against}"] = library_at(args.against, Path(tmp), isas[-1])
        for m in args.rows:
            xs = [torch.randn(m, k, generator=g) for _, k, _ in shapes]
            cols = [(name, lib, 0) for name, lib in libs.items()]
            if args.weights == "int6":
                cols.append((f"{best}_as_int8", libs[best], 3))
            if args.act8:
                cols += [(f"kernels_{isa}_a8", libs[f"kernels_{isa}"], 2) for isa in isas]
                if args.against:
                    cols.append((f"kernels_{args.against}_a8", libs[f"kernels_{args.against}"], 2))
            fns = {name: one_pass(lambda x, w, lib=lib, j=j: cpu.linear(lib, x, w[j]), xs, weights,
                                  i * n_copies // (len(cols) + 1))
                   for i, (name, lib, j) in enumerate(cols)}
            fns["torch"] = one_pass(lambda x, w: F.linear(x, w[1]), xs, weights,
                                    len(cols) * n_copies // (len(cols) + 1))
            t = rotated(fns)
            gf = {k: flops_per_row * m / (t[k] * 1e-3) / 1e9 for k in fns}
            rows.append({"rows": m, **{f"{k}_ms": round(t[k], 3) for k in gf},
                         **{f"{k}_gflops": round(v, 1) for k, v in gf.items()},
                         "best_vs_row": round(t["row"] / t[best], 2),
                         "best_vs_avx2": round(t["kernels_avx2"] / t[best], 2),
                         "best_vs_torch": round(t["torch"] / t[best], 2)})
            r = rows[-1]
            cols = "  ".join(f"{k} {r[f'{k}_ms']:7.3f} ms ({r[f'{k}_gflops']:5.1f} GF/s)" for k in fns)
            print(f"M={m:4d}  {cols} | {best} vs row {r['best_vs_row']:.2f}x, vs avx2 {r['best_vs_avx2']:.2f}x, "
                  f"vs torch {r['best_vs_torch']:.2f}x", flush=True)
    path = write_json("linear.json", {"threads": torch.get_num_threads(), "copies": n_copies, "isas": isas,
                                      "layers": args.layers, "weights": args.weights, "act8": args.act8,
                                      "against": args.against, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
