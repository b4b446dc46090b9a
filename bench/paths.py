"""Every execution path tokenspout offers for the default model, served, in one run: dtype x quantization x ISA level.

    python -m bench.paths [--concurrency 1 16] [--mode greedy] [--max-tokens 64] [--rounds 1]

Paths (each a `tokenspout serve` started with those flags, one server at a time, measured with bench/serve.py:
closed loop, streamed, ignore_eos):
* dtype float32 x quantization none / bf16 / fp16 / int8 / int4 x kernels at each ISA level the CPU has
  (TOKENSPOUT_ISA=avx2, avx512) and with the kernels off (TOKENSPOUT_KERNELS=0: the torch model alone; not for the
  16-bit weights, which only the kernels read);
* dtype bfloat16 x none / int8 / int4 (the kernels take float32 models only: bfloat16 always runs the torch model);
* `auto`: the server as `make serve` starts it (no flags), which is the row the defaults must keep within 5% of the
  fastest;
* `batch-invariant`: `auto` with --batch-invariant, to show what the guarantee costs (not a speed path: left out of
  the "fastest" comparisons; at one sequence it runs auto's kernels).
The table marks the configuration `auto` resolves to (`*`).  With --rounds N every path is measured N times,
interleaved (round 1 of every path, then round 2, ...), and the median per level is reported: the VM drifts
between minutes.  Writes bench/results/paths.json (or --out NAME there: a partial run with --only need not replace
the full table's results) and prints a markdown table (the one in README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import serve
from bench.common import write_json

ROOT = Path(__file__).resolve().parent.parent
PORT = 8010


@dataclass(slots=True)
class ServePath:
    name: str
    flags: list[str]
    env: dict[str, str] = field(default_factory=dict)


def isas() -> list[str]:
    code = "from tokenspout.kernels import cpu; print(' '.join(cpu.available_isas()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return out.stdout.split()


def auto_choice() -> dict:
    """What `tokenspout serve` with no flags resolves to on this machine: dtype, quantization, ISA level."""
    code = ("import json; from tokenspout.kernels import cpu; from tokenspout.models.loader import resolve_dtype; "
            "from tokenspout.entrypoints.cli import resolve_quantization; "
            "print(json.dumps({'dtype': str(resolve_dtype('auto')).removeprefix('torch.'), "
            "'quantization': resolve_quantization('auto', None) or 'none', "
            "'isa': cpu.chosen_isa() if cpu.load() is not None else 'off'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


INVARIANT = "batch-invariant"


def is_speed_path(name: str) -> bool:
    """Whether the fastest row is chosen among this path: not `auto` (a configuration measured again) nor
    `batch-invariant` (a guarantee, not a speed path)."""
    return name not in ("auto", INVARIANT)


def all_paths(levels: list[str]) -> list[ServePath]:
    paths = [ServePath("auto", []), ServePath(INVARIANT, ["--batch-invariant"])]
    for quant in ("none", "bf16", "fp16", "int8", "int4"):
        # 16-bit float weights exist only in the kernels (with them off the torch model runs float32: the "none" row)
        for isa in [*levels, "off"] if quant not in ("bf16", "fp16") else levels:
            env = {"TOKENSPOUT_KERNELS": "0"} if isa == "off" else {"TOKENSPOUT_ISA": isa}
            paths.append(ServePath(f"float32/{quant}/{isa}", ["--dtype", "float32", "--quantization", quant], env))
        if quant not in ("bf16", "fp16"):
            paths.append(ServePath(f"bfloat16/{quant}/torch", ["--dtype", "bfloat16", "--quantization", quant]))
    return paths


def measure(p: ServePath, args: argparse.Namespace, peers: Path) -> dict:
    env = dict(os.environ, PEERS=os.environ.get("PEERS", "/tmp/peers"), **p.env)
    name = "paths-" + p.name.replace("/", "-")
    cmd = [str(peers / "start_server.sh"), name, f"http://127.0.0.1:{PORT}/health", "--",
           str(ROOT / ".venv" / "bin" / "tokenspout"), "serve", "--port", str(PORT), *p.flags]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{p.name} did not start: {res.stdout[-2000:]}{res.stderr[-2000:]}")
    startup = json.loads((Path(env["PEERS"]) / "logs" / f"{name}.startup.json").read_text())["startup_s"]
    try:
        sargs = serve.parse_args(["--base-url", f"http://127.0.0.1:{PORT}/v1", "--model", "SmolLM2-135M-Instruct",
                                  "--concurrency", *map(str, args.concurrency), "--mode", *args.mode,
                                  "--max-tokens", str(args.max_tokens), "--label", p.name]
                                 + (["--num-requests", str(args.num_requests)] if args.num_requests else []))
        out = asyncio.run(serve.run(sargs))
    finally:
        subprocess.run([str(peers / "stop_server.sh"), name], capture_output=True, text=True, env=env, check=False)
    rss = Path(env["PEERS"]) / "logs" / f"{name}.rss.json"
    out["startup_s"] = startup
    out["peak_rss_mib"] = json.loads(rss.read_text()).get("peak_total_rss_mib") if rss.is_file() else None
    return out


def merge(rounds: list[dict]) -> dict:
    """Median tok/s and ITL p50 per (mode, concurrency) over the rounds of one path."""
    levels = [(r["mode"], r["concurrency"]) for r in rounds[0]["results"]]
    rows = []
    for mode, c in levels:
        rs = [next(x for x in rd["results"] if (x["mode"], x["concurrency"]) == (mode, c)) for rd in rounds]
        rows.append({"mode": mode, "concurrency": c,
                     "output_tok_s": statistics.median(r["output_tok_s"] or 0 for r in rs),
                     "itl_p50_ms": statistics.median(r["itl_p50_ms"] or 0 for r in rs),
                     "ttft_p50_ms": statistics.median(r["ttft_p50_ms"] or 0 for r in rs),
                     "errors": sum(r["errors"] for r in rs), "rounds": [r["output_tok_s"] for r in rs]})
    return {"results": rows, "startup_s": statistics.median(r["startup_s"] for r in rounds),
            "peak_rss_mib": max((r["peak_rss_mib"] or 0) for r in rounds)}


def table(report: dict) -> str:
    names = list(report["paths"])
    levels = [(r["mode"], r["concurrency"]) for r in report["paths"][names[0]]["results"]]
    head = "| path (dtype/quantization/kernels) | " + " | ".join(f"c={c} {m} tok/s (ITL p50 ms)" for m, c in levels)
    lines = [head + " | peak RSS MiB |", "|" + "---|" * (len(levels) + 2)]
    best = {lv: max((report["paths"][n]["results"][i]["output_tok_s"] for n in names if is_speed_path(n)), default=None)
            for i, lv in enumerate(levels)}
    for n in names:
        res = report["paths"][n]["results"]
        cells = [f"{r['output_tok_s']:.0f} ({r['itl_p50_ms']:.1f})"
                 + (" **fastest**" if is_speed_path(n) and r["output_tok_s"] == best[lv] else "")
                 for r, lv in zip(res, levels, strict=True)]
        mark = " *" if n == report["auto_resolves_to"] else ""
        label = f"auto = {report['auto_resolves_to']}" if n == "auto" else n + mark
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {report['paths'][n]['peak_rss_mib'] or 0:.0f} |")
    for key, what in (("auto_vs_fastest", "`auto` vs the fastest row"), ("invariant_vs_auto", "`batch-invariant` vs `auto`")):
        if key in report:
            ratios = ", ".join(f"c={c} {m} {report[key][f'{m}/c{c}']:.2f}x" for m, c in levels)
            lines.append(f"\n{what}: {ratios}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--mode", nargs="+", default=["greedy"])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--only", nargs="*", default=None, help="measure only these path names (e.g. auto float32/int4/avx512)")
    ap.add_argument("--out", default="paths.json", help="results file name under bench/results/")
    ap.add_argument("--peers-dir", type=Path, default=ROOT.parent / "shared" / "peers")
    args = ap.parse_args()
    choice = auto_choice()
    paths = [p for p in all_paths(isas()) if args.only is None or p.name in args.only]
    resolved = f"{choice['dtype']}/{choice['quantization']}/{choice['isa'] if choice['dtype'] == 'float32' else 'torch'}"
    print(f"auto resolves to {resolved}", flush=True)
    rounds: dict[str, list[dict]] = {p.name: [] for p in paths}
    for r in range(args.rounds):
        for p in paths:
            print(f"== round {r + 1}: {p.name}", flush=True)
            rounds[p.name].append(measure(p, args, args.peers_dir))
    report: dict = {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "max_tokens": args.max_tokens,
                    "rounds": args.rounds, "auto_resolves_to": resolved,
                    "paths": {name: merge(rs) for name, rs in rounds.items()}}
    # `auto` is judged by the row of the configuration it resolves to (the separate "auto" server is the same
    # configuration measured once more: the difference between the two is this VM's run-to-run noise)
    judged = resolved if resolved in report["paths"] else "auto"
    others = [n for n in report["paths"] if is_speed_path(n)]
    if judged in report["paths"] and others:
        mine = report["paths"][judged]["results"]
        report["auto_vs_fastest"] = {
            f"{r['mode']}/c{r['concurrency']}": r["output_tok_s"] / max(
                report["paths"][n]["results"][i]["output_tok_s"] for n in others)
            for i, r in enumerate(mine)}
    if "auto" in report["paths"] and INVARIANT in report["paths"]:
        report["invariant_vs_auto"] = {
            f"{r['mode']}/c{r['concurrency']}": r["output_tok_s"] / a["output_tok_s"]
            for r, a in zip(report["paths"][INVARIANT]["results"], report["paths"]["auto"]["results"], strict=True)}
    if len(report["paths"]) > 1:
        print(table(report))
    print("wrote", write_json(args.out, report))


if __name__ == "__main__":
    main()
