"""The serving path's own cost per token: CPU of the API server and of the engine process while a tiny model streams.

    python -m bench.frontend                          # c = 1 and 16, 3 rounds
    python -m bench.frontend --against HEAD~1         # that revision's tree serves in alternate rounds too

The model is bench.shapes' `tiny` (two layers 64 wide, random weights, the default vocabulary and tokenizer), served
with `--quantization int4 --num-threads 1`: its forward is the same in every tree and small (~0.6 ms a one-row step
on a 2-core AVX2 EPYC, nearly all of it the LM head's 49,152 rows of 64, where per-block overhead dominates), so what
differs between trees and what the API server spends is the serving path (the scheduler, input preparation, the
sampler over the 49,152-token vocabulary, the engine's outputs, the API server's reading, detokenization, SSE
framing and HTTP writes).  On a small machine that CPU comes out of the decode threads: at one client the default
model's token is ~6 ms, and every 0.1 ms the two processes spend on it outside the kernels is ~1.5% of the token
rate.

Per level (bench.serve's load: greedy, streamed, 128 tokens a request, ignore_eos): tok/s, ITL p50 and the CPU time
(/proc/<pid>/stat utime + stime, the process's every thread) the API server and the engine took per streamed token.
Each round starts a fresh server per tree; with --against REV, REV's tree (a git worktree, removed afterwards) and
this one alternate, and the medians of each are compared: this VM's speed drifts by 10-20% over minutes, and the
CPU-per-token columns drift far less than tok/s.  Results go to bench/results/frontend.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from bench import serve
from bench.common import ROOT, start_tokenspout, stop_server, write_json

CLK = os.sysconf("SC_CLK_TCK")


def tiny_model() -> Path:
    import torch

    from bench.shapes import make
    from tokenspout.models.default_model import cache_dir

    return make("tiny", cache_dir() / "shapes" / "tiny-float32", torch.float32)


def cpu_ticks(pid: int) -> int:
    """utime + stime of the process (all its threads), in clock ticks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, ValueError, IndexError):
                pass
    return out


def level(url: str, concurrency: int, num_requests: int, max_tokens: int, api: int, engine: int) -> dict:
    sargs = serve.parse_args(["--base-url", url + "/v1", "--model", "tiny", "--concurrency",
                              str(concurrency), "--mode", "greedy", "--max-tokens", str(max_tokens),
                              "--num-requests", str(num_requests), "--label", "frontend"])
    before = cpu_ticks(api), cpu_ticks(engine)
    res = asyncio.run(serve.run(sargs))["results"][0]
    after = cpu_ticks(api), cpu_ticks(engine)
    tokens = num_requests * max_tokens
    return {"concurrency": concurrency, "output_tok_s": res["output_tok_s"], "itl_p50_ms": res["itl_p50_ms"],
            "api_cpu_ms_per_token": (after[0] - before[0]) / CLK * 1e3 / tokens,
            "engine_cpu_ms_per_token": (after[1] - before[1]) / CLK * 1e3 / tokens, "errors": res["errors"]}


def measure(tree: Path, model: Path, args: argparse.Namespace) -> list[dict]:
    proc, url, _ = start_tokenspout([str(model), "--served-model-name", "tiny", "--quantization", "int4",
                                     "--num-threads", "1"], tree=tree,
                                    log=Path(tempfile.gettempdir()) / f"bench-frontend-{tree.name}.log")
    try:
        engines = children(proc.pid)
        if len(engines) != 1:
            raise RuntimeError(f"expected one engine process under {proc.pid}, found {engines}")
        level(url, 1, 4, 16, proc.pid, engines[0])  # warm-up: first requests, compiled paths, caches
        return [level(url, c, args.num_requests or max(32, 2 * c), args.max_tokens, proc.pid, engines[0])
                for c in args.concurrency]
    finally:
        stop_server(proc)


KEYS = ("output_tok_s", "itl_p50_ms", "api_cpu_ms_per_token", "engine_cpu_ms_per_token")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=None, help="per level (default: max(32, 2 x concurrency))")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--against", default=None, help="a git revision whose tree serves in alternate rounds")
    ap.add_argument("--out", default="frontend.json")
    args = ap.parse_args()
    model = tiny_model()
    trees = {"current": ROOT}
    tmp = None
    if args.against:
        tmp = Path(tempfile.mkdtemp(prefix="bench-frontend-"))
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tmp / "against"), args.against],
                       check=True, capture_output=True)
        trees[args.against] = tmp / "against"
    rounds: dict[str, list[list[dict]]] = {name: [] for name in trees}
    try:
        for r in range(args.rounds):
            for name, tree in (trees.items() if r % 2 == 0 else reversed(trees.items())):
                rows = measure(tree, model, args)
                rounds[name].append(rows)
                for row in rows:
                    print(f"round {r + 1} {name:>12} c={row['concurrency']:<3} "
                          + "  ".join(f"{k} {row[k]:.3f}" for k in KEYS), flush=True)
    finally:
        if tmp is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tmp / "against")],
                           capture_output=True)
            shutil.rmtree(tmp, ignore_errors=True)
    summary = {name: [{"concurrency": c, **{k: statistics.median(rs[i][k] for rs in rows) for k in KEYS}}
                      for i, c in enumerate(args.concurrency)] for name, rows in rounds.items()}
    print(f"\nmedians of {args.rounds} rounds")
    print(f"{'tree':>12} {'c':>3} {'tok/s':>9} {'ITL p50 ms':>11} {'API ms/tok':>11} {'engine ms/tok':>14}")
    for name, rows in summary.items():
        for row in rows:
            print(f"{name:>12} {row['concurrency']:>3} {row['output_tok_s']:>9.1f} {row['itl_p50_ms']:>11.3f} "
                  f"{row['api_cpu_ms_per_token']:>11.3f} {row['engine_cpu_ms_per_token']:>14.3f}")
    print(f"wrote {write_json(args.out, {'args': vars(args), 'summary': summary, 'rounds': rounds})}")


if __name__ == "__main__":
    main()
