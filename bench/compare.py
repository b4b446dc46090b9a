"""tokenspout against its peers (vLLM CPU, llama.cpp) in one run: the same prompts, load generator and minutes.

    python -m bench.compare [--servers tokenspout tokenspout-fp32 vllm llamacpp] [--concurrency 1 16 64]
                            [--mode greedy random] [--max-tokens 128] [--context TOKENS] [--peers-dir ../shared/peers]

Servers are started one at a time (2 cores: never measure two at once) through ../shared/peers/start_server.sh,
which records start-up time (to a healthy /health) and the peak RSS of the server's whole process tree:
* tokenspout       `tokenspout serve` with `make serve`'s defaults (the default model; --quantization auto = int4);
* tokenspout-fp32  the same with --quantization none (float32 weights, what vLLM serves);
* vllm             vLLM CPU 0.32 on the same float32 folder (`vllm.sh`; install it first: vllm.sh install);
* vllm-bf16        the same served in bfloat16 (DTYPE=bfloat16: vLLM's fast path on AVX512-BF16 CPUs);
* llamacpp         llama.cpp's server on the original Q4_1 GGUF (`llamacpp.sh`; llamacpp.sh install).
Each server is measured with bench/serve.py (closed loop, streamed, ignore_eos; `--context N`: a document of about N
tokens before each question, decoding at that depth).  Writes
bench/results/serve_compare.json and prints a markdown table (the one in README.md).

`--rounds N` (N > 1): every server is started first (one at a time, each start timed alone) and all stay up, idle
but one; then each round measures every level on every server in turn (the servers' order reversed every other
round), and the table shows each level's median over the rounds (`rounds` in the JSON keeps every round's row).
This VM's speed drifts by 10-20% from one minute to the next, and one server measured after another compared
their minutes as much as their code: interleaved rounds give every server the same minutes.  An idle server takes
no CPU (tokenspout and vLLM wait on their sockets, llama.cpp's threads sleep between requests).
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
from pathlib import Path

from bench import serve
from bench.common import write_json

ROOT = Path(__file__).resolve().parent.parent
PORTS = {"tokenspout": 8000, "tokenspout-fp32": 8001, "vllm": 8100, "vllm-bf16": 8101, "llamacpp": 8200}


def model_dir() -> str:
    code = "from tokenspout.models.default_model import default_model_path; print(default_model_path())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def start(name: str, peers: Path, env: dict) -> dict:
    port = PORTS[name]
    if name.startswith("tokenspout"):
        cmd = [str(peers / "start_server.sh"), name, f"http://127.0.0.1:{port}/health", "--",
               str(ROOT / ".venv" / "bin" / "tokenspout"), "serve", "--port", str(port)]
        if name == "tokenspout-fp32":
            cmd += ["--quantization", "none"]
    elif name.startswith("vllm"):
        cmd = [str(peers / "vllm.sh"), "start", model_dir(), str(port)]
        env = dict(env, DTYPE="bfloat16" if name == "vllm-bf16" else "float32")
    else:
        cmd = [str(peers / "llamacpp.sh"), "start", str(port)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    print(res.stdout.strip().splitlines()[-1] if res.stdout.strip() else res.stderr[-500:], flush=True)
    if res.returncode != 0:
        raise RuntimeError(f"{name} did not start: {res.stdout[-2000:]}{res.stderr[-2000:]}")
    logs = Path(env["PEERS"]) / "logs"
    return json.loads((logs / f"{'vllm' if name.startswith('vllm') else name}.startup.json").read_text())


def stop(name: str, peers: Path, env: dict) -> dict:
    script = {"vllm": "vllm.sh", "vllm-bf16": "vllm.sh", "llamacpp": "llamacpp.sh"}.get(name)
    cmd = [str(peers / script), "stop"] if script else [str(peers / "stop_server.sh"), name]
    subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    rss = Path(env["PEERS"]) / "logs" / f"{'vllm' if name.startswith('vllm') else name}.rss.json"
    return json.loads(rss.read_text()) if rss.is_file() else {}


def serve_args(name: str, args: argparse.Namespace, concurrency: list[int], modes: list[str]) -> argparse.Namespace:
    model = "smollm2" if name in ("vllm", "vllm-bf16", "llamacpp") else "SmolLM2-135M-Instruct"
    return serve.parse_args(["--base-url", f"http://127.0.0.1:{PORTS[name]}/v1", "--model", model,
                             "--concurrency", *map(str, concurrency), "--mode", *modes,
                             "--max-tokens", str(args.max_tokens), "--label", name, "--context", str(args.context)]
                            # llama.cpp's repetition penalty defaults on; the others' are off already
                            + (["--extra-body", '{"repeat_penalty": 1.0}'] if name == "llamacpp" else [])
                            + (["--num-requests", str(args.num_requests)] if args.num_requests else []))


def median_row(rows: list[dict]) -> dict:
    """One level's rounds -> the round with the median output tok/s, its TTFT / ITL the medians of all rounds',
    and every round's row under `rounds`."""
    ok = [r for r in rows if r["completed"]] or rows
    mid = dict(sorted(ok, key=lambda r: r["output_tok_s"])[len(ok) // 2])
    for key in ("ttft_p50_ms", "itl_p50_ms"):
        mid[key] = statistics.median(r[key] for r in ok)
    mid["errors"] = sum(r["errors"] for r in rows)
    mid["rounds"] = rows
    return mid


def interleave(names: list[str], rounds: int, levels: list, measure, label) -> dict[str, dict]:
    """Every level measured on every server in turn, `rounds` times, the servers' order reversed every other round
    (each server gets the same minutes): name -> level -> that level's result rows of every round.
    measure(name, level) -> result rows; label(level) names a level in the progress lines."""
    rows: dict[str, dict] = {n: {} for n in names}
    for rnd in range(rounds):
        for level in levels:
            for name in names if rnd % 2 == 0 else names[::-1]:
                got = measure(name, level)
                rows[name].setdefault(level, []).extend(got)
                print(f"round {rnd + 1} {name} {label(level)}: {got[0]['output_tok_s']:.1f} tok/s", flush=True)
    return rows


def run_rounds(args: argparse.Namespace, env: dict, report: dict) -> None:
    """--rounds: every server up at once, every level measured on each in turn, round after round."""
    up: dict[str, dict] = {}
    try:
        for name in args.servers:
            print(f"== start {name}", flush=True)
            try:
                up[name] = start(name, args.peers_dir, env)
            except RuntimeError as e:
                print(e, flush=True)
                stop(name, args.peers_dir, env)
        levels = [(m, c) for m in args.mode for c in args.concurrency]
        rows = interleave(list(up), args.rounds, levels,
                          lambda name, lv: asyncio.run(serve.run(serve_args(name, args, [lv[1]], [lv[0]])))["results"],
                          lambda lv: f"{lv[0]} c={lv[1]}")
        for name in up:
            report["servers"][name] = {"label": name, "results": [median_row(rows[name][lv]) for lv in levels],
                                       "startup_s": up[name]["startup_s"]}
    finally:
        for name in list(up)[::-1]:
            rss = stop(name, args.peers_dir, env)
            if name in report["servers"]:
                report["servers"][name]["peak_rss_mib"] = rss.get("peak_total_rss_mib")
    report["rounds"] = args.rounds


def table(report: dict) -> str:
    names = list(report["servers"])
    head = "| output tok/s (TTFT p50 ms) | " + " | ".join(names) + " |"
    lines = [head, "|" + "---|" * (len(names) + 1)]
    levels = [(r["mode"], r["concurrency"]) for r in next(iter(report["servers"].values()))["results"]]
    for mode, c in levels:
        cells = []
        for n in names:
            r = next((x for x in report["servers"][n]["results"] if (x["mode"], x["concurrency"]) == (mode, c)), None)
            if r is None or not r["completed"]:  # (a level whose every request failed has no figures)
                cells.append("—" if r is None else f"{r['errors']} err: {(r['first_errors'] or [''])[0][:80]}")
                continue
            cells.append(f"{r['output_tok_s']:.0f} ({r['ttft_p50_ms']:.0f})"
                         + (f" {r['errors']} err" if r["errors"] else ""))
        lines.append(f"| c={c} {mode} | " + " | ".join(cells) + " |")
    st = [f"{report['servers'][n]['startup_s']:.1f} s / {report['servers'][n].get('peak_rss_mib', 0):.0f} MiB"
          for n in names]
    lines.append("| start to healthy / peak RSS | " + " | ".join(st) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", nargs="+", default=["tokenspout", "tokenspout-fp32", "vllm", "llamacpp"],
                    choices=list(PORTS))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--mode", nargs="+", default=["greedy", "random"])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--context", type=int, default=0,
                    help="about this many tokens of document before each question (bench.serve --context): decoding "
                         "at depth; llama.cpp then gets one slot per client of context + 1024 tokens")
    ap.add_argument("--peers-dir", type=Path, default=ROOT.parent / "shared" / "peers")
    ap.add_argument("--rounds", type=int, default=1,
                    help="> 1: all servers up at once, every level measured on each in turn per round, medians")
    ap.add_argument("--out", default="serve_compare.json")
    args = ap.parse_args()
    env = dict(os.environ, PEERS=os.environ.get("PEERS", "/tmp/peers"))
    if args.context:  # llama.cpp's default slots (64 x 512 tokens) cannot hold the prompts
        np_ = max(args.concurrency)
        env.update(NP=str(np_), CTX=str(np_ * (args.context + args.max_tokens + 1024)))
    report: dict = {"max_tokens": args.max_tokens, "context": args.context,
                    "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "servers": {}}
    if args.rounds > 1:
        run_rounds(args, env, report)
        print(table(report))
        print("wrote", write_json(args.out, report))
        return
    for name in args.servers:
        print(f"== {name}", flush=True)
        try:
            info = start(name, args.peers_dir, env)
        except RuntimeError as e:
            print(e, flush=True)
            stop(name, args.peers_dir, env)
            continue
        try:
            res = asyncio.run(serve.run(serve_args(name, args, args.concurrency, args.mode)))
        finally:
            rss = stop(name, args.peers_dir, env)
        res["startup_s"] = info["startup_s"]
        res["peak_rss_mib"] = rss.get("peak_total_rss_mib")
        report["servers"][name] = res
        write_json(args.out, report)
    print(table(report))
    print("wrote", write_json(args.out, report))


if __name__ == "__main__":
    main()
