"""Decode attention (the C kernels' `ts_attn_decode`) over a paged float16 KV cache, against the memory read
bandwidth measured in the same run, and optionally against the library of another git revision.

    python -m bench.attention [--shapes smollm2-135m smollm2-1.7b] [--tokens 16 64] [--positions 200]
                              [--against REV] [--out attention.json]
    python -m bench.attention --prompt --tokens 512 --positions 0 3584 --out attention_prompt.json

Per model shape (query heads, KV heads, head dim: SmolLM2-135M 9/3/64, SmolLM2-360M 15/5/64, SmolLM2-1.7B 32/32/64
(no GQA), Llama-3.1-8B 32/8/128), `--tokens` decode tokens each attend to `--positions` positions of their own
blocks (16 positions a block, shuffled over the cache as an allocator leaves them); one call per layer over
LAYERS distinct caches (so each call reads its cache from memory, as a step does), timed as one "step" of
LAYERS calls, median of alternating rounds.  `GB/s` = the K and V bytes a step must read / its time; `ratio` = that
/ a 1 GiB float32 `sum()` with the same threads (bench.bandwidth's reader).  `--against REV` builds the kernels
of git revision REV (its tokenspout/kernels/csrc) and times both libraries in alternating rounds (results must be
bit-identical where the order of the sums is the same).  Writes bench/results/attention.json.
`--prompt`: the `--tokens` are instead one sequence's prompt chunk after `--positions` cached positions (token j
attends to positions + j + 1 of them, all over one block table), as a prefill step computes them; `GB/s` then counts
the cache bytes once and `GFLOP/s` the products' (2 x scores + 2 x value sums) multiply-adds.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the engine process runs (set before torch loads libgomp)
import torch

from bench.bandwidth import read_bandwidth
from bench.common import library_at, write_json
from tokenspout.kernels import cpu

SHAPES = {"smollm2-135m": (9, 3, 64), "smollm2-360m": (15, 5, 64), "smollm2-1.7b": (32, 32, 64),
          "llama-8b": (32, 8, 128)}
LAYERS = 24
BLOCK = 16


def case(libs: dict[str, ctypes.CDLL], shape: str, tokens: int, positions: int, rounds: int, prompt: bool) -> dict:
    h, hkv, d = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    if prompt:  # one sequence: its cached positions, then the chunk's tokens
        nb = (positions + tokens + BLOCK - 1) // BLOCK
        nblocks = nb
        table = torch.randperm(nblocks, generator=g).view(1, nb).expand(tokens, nb).contiguous()
        lens = torch.arange(positions + 1, positions + tokens + 1, dtype=torch.int64)
    else:
        nb = (positions + BLOCK - 1) // BLOCK
        nblocks = tokens * nb
        table = torch.randperm(nblocks, generator=g).view(tokens, nb).contiguous()
        lens = torch.full((tokens,), positions, dtype=torch.int64)
    caches = [torch.randn(2, nblocks * BLOCK, hkv, d, generator=g).half() for _ in range(LAYERS)]
    q = torch.randn(tokens, h * d, generator=g)
    outs = {name: torch.empty(tokens, h * d) for name in libs}

    def step(name: str) -> None:
        for kv in caches:
            libs[name].ts_attn_decode(q.data_ptr(), h * d, kv.data_ptr(), nblocks * BLOCK, table.data_ptr(), nb,
                                      lens.data_ptr(), BLOCK, tokens, h, hkv, d, ctypes.c_float(d**-0.5),
                                      outs[name].data_ptr(), h * d, 1)

    times: dict[str, list[float]] = {name: [] for name in libs}
    names = list(libs)
    for name in names:
        step(name)
    same = all(torch.equal(outs[n], outs[names[0]]) for n in names)
    diff = max(float((outs[n] - outs[names[0]]).abs().max()) for n in names)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            step(name)
            times[name].append(time.perf_counter() - t0)
    nbytes = 2 * (positions + tokens if prompt else tokens * positions) * hkv * d * 2 * LAYERS
    flops = 2 * 2 * int(lens.sum()) * h * d * LAYERS
    row: dict = {"shape": shape, "tokens": tokens, "positions": positions, "prompt": prompt, "bytes": nbytes,
                 "bit_identical": same, "max_abs_diff": diff}
    for name in names:
        s = statistics.median(times[name])
        row[name] = {"ms": round(s * 1e3, 2), "gb_s": round(nbytes / s / 1e9, 2),
                     "gflop_s": round(flops / s / 1e9, 1)}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--positions", type=int, nargs="+", default=[200])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--against", default=None, help="a git revision whose kernels to time beside today's")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompt", action="store_true", help="the tokens are one sequence's prompt chunk (see above)")
    ap.add_argument("--out", default="attention.json", help="file name under bench/results/")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lib, isa = cpu.load(), cpu.chosen_isa()
    if lib is None or isa is None:
        raise SystemExit("the C kernels are unavailable on this machine")
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"now": lib}
        if args.against:
            libs[args.against] = library_at(args.against, Path(tmp), isa)
        bw = read_bandwidth()
        rows = []
        for shape in args.shapes:
            for t, n in [(t, n) for n in args.positions for t in args.tokens]:
                row = case(libs, shape, t, n, args.rounds, args.prompt)
                for name in libs:
                    row[name]["ratio"] = round(row[name]["gb_s"] / bw, 3)
                rows.append(row)
                cols = "  ".join(f"{n}: {row[n]['ms']:7.2f} ms {row[n]['gb_s']:5.1f} GB/s ({row[n]['ratio']:.2f}x)"
                                 + (f" {row[n]['gflop_s']:5.1f} GFLOP/s" if args.prompt else "") for n in libs)
                differ = "" if row["bit_identical"] else f"  results differ by up to {row['max_abs_diff']:.2g}"
                print(f"{shape:13s} {t:3d} tokens x {n:5d} positions  {cols}{differ}", flush=True)
    path = write_json(args.out, {"threads": torch.get_num_threads(), "read_gb_s": round(bw, 2), "layers": LAYERS,
                                 "against": args.against, "rows": rows})
    print(f"read bandwidth {bw:.1f} GB/s; wrote {path}")


if __name__ == "__main__":
    main()
