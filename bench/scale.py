"""Scaling out on one machine: `tokenspout serve --data-parallel-size N` against one engine with all the threads,
measured by bench/serve.py (closed loop, streamed, ignore_eos) in one run.

Configurations (default): N=1 engine x 2 threads (the default on this 2-core machine) and N=2 engines x 1 thread,
each a fresh `tokenspout serve` (make serve's defaults otherwise: the default model, int4), at concurrency 1, 16, 64,
greedy and random.  `--rounds R` measures the configurations R times, alternating, and reports medians.  Also
measures one engine's own scaling with threads (N=1 x 1 thread), which is what tells a bigger machine's outlook.
Ray Serve rows (README, Scaling out: Many machines): `tokenspout serve --ray` with 1 and 2 replicas of 1 thread
each (ray1x1, ray2x1), on a local Ray cluster that the server process starts and stops, measured through Ray
Serve's HTTP proxy by the same load generator.  Writes bench/results/scale.json (configurations not measured in
this run keep their earlier rows there, each with its own `measured_at`) and prints a table.

    python -m bench.scale                      # full (~10 min on 2 cores)
    python -m bench.scale --configs 1x2 2x1 ray1x1 ray2x1
    python -m bench.scale --concurrency 1 64 --mode random --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from bench import serve
from bench.common import RESULTS, start_tokenspout, stop_server, write_json

CONFIGS = {  # name -> serve flags
    "1x2": ["--data-parallel-size", "1", "--num-threads", "2"],
    "2x1": ["--data-parallel-size", "2", "--num-threads", "1"],
    "1x1": ["--data-parallel-size", "1", "--num-threads", "1"],
    "ray1x1": ["--ray", "--num-replicas", "1", "--num-threads", "1"],
    "ray2x1": ["--ray", "--num-replicas", "2", "--num-threads", "1"],
}
DEFAULT_CONFIGS = ["1x2", "2x1", "1x1", "ray1x1", "ray2x1"]


def measure(name: str, args: argparse.Namespace) -> dict:
    proc, url, startup = start_tokenspout(CONFIGS[name])
    try:
        sargs = serve.parse_args(["--base-url", url + "/v1", "--model", "SmolLM2-135M-Instruct", "--concurrency",
                                  *map(str, args.concurrency), "--mode", *args.mode, "--max-tokens",
                                  str(args.max_tokens), "--label", name])
        res = asyncio.run(serve.run(sargs))
    finally:
        stop_server(proc)
    res["startup_s"] = startup
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--mode", nargs="+", default=["greedy", "random"])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default="scale.json")
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {c: [] for c in args.configs}
    for r in range(args.rounds):
        order = args.configs if r % 2 == 0 else list(reversed(args.configs))
        for name in order:
            print(f"== round {r + 1}: {name}", flush=True)
            runs[name].append(measure(name, args))
    table: dict[str, dict[str, float]] = {}
    for name, results in runs.items():
        for row in results[0]["results"]:
            key = f"c={row['concurrency']} {row['mode']}"
            vals = [next(x for x in res["results"] if x["concurrency"] == row["concurrency"]
                         and x["mode"] == row["mode"])["output_tok_s"] for res in results]
            table.setdefault(key, {})[name] = statistics.median(vals)
    base = args.configs[0]
    print("\noutput tok/s (median of rounds), ratio vs " + base)
    print("level".ljust(16) + "".join(n.rjust(16) for n in args.configs))
    for key, row in table.items():
        print(key.ljust(16) + "".join(f"{row[n]:9.1f} ({row[n] / row[base]:.2f}x)".rjust(16)
                                      for n in args.configs))
    print("wrote", write_json(args.out, merge_previous(args, table, runs)))


def merge_previous(args: argparse.Namespace, table: dict[str, dict[str, float]], runs: dict[str, list[dict]]) -> dict:
    """This run's results, plus the configurations of the existing results file that this run did not measure
    (same max_tokens only), so one file holds every row of the README's table."""
    now = time.time()
    data = {"configs": {n: CONFIGS[n] for n in args.configs}, "rounds": args.rounds, "max_tokens": args.max_tokens,
            "measured_at": {n: now for n in args.configs}, "table": table, "runs": runs}
    path = RESULTS / args.out
    if not path.exists():
        return data
    old = json.loads(path.read_text())
    if old.get("max_tokens") != args.max_tokens:
        return data
    for name, flags in old.get("configs", {}).items():
        if name in args.configs:
            continue
        data["configs"][name] = flags
        data["measured_at"][name] = old.get("measured_at", {}).get(name, old.get("time"))
        data["runs"][name] = old["runs"][name]
        for key, row in old.get("table", {}).items():
            if name in row:
                data["table"].setdefault(key, {})[name] = row[name]
    return data


if __name__ == "__main__":
    main()
