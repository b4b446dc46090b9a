"""Real model sizes against llama.cpp: random-weight Llama shapes served by tokenspout and by llama.cpp, one at a time.

    python -m bench.sizes [--shapes smollm2-1.7b] [--concurrency 1 16] [--max-tokens 64] [--rounds N]

Per shape (bench/shapes.py: SmolLM2-360M, SmolLM2-1.7B, Llama-3.1-8B's layer shape; the default tokenizer's
vocabulary; bf16 safetensors):
* the GGUF files are made with llama.cpp's own tools from the source `../shared/peers/llamacpp.sh install` unpacked
  and built: `convert_hf_to_gguf.py --outtype bf16` then `llama-quantize` (Q4_1, Q8_0, Q4_K_M and Q5_K_M; build the
  llama-quantize target of that build folder first);
* servers per quantization family (Q4_1 / int4, Q8_0 / int8, Q4_K_M and Q5_K_M / the file), each on cold caches (the quantized-weights cache is
  deleted per shape, so the first start is measured): `llamacpp-q4_1` / `llamacpp-q8_0` (llama-server, 16 slots x
  512 tokens, f16 KV cache), `tokenspout-int4` / `tokenspout-int8` (the bf16 folder, --quantization) and
  `tokenspout-gguf-q4_1` / `tokenspout-gguf-q8_0` (the file, read directly), tokenspout with --kv-cache-dtype float16
  and the KV budget of llama.cpp's 16 x 512 tokens, so every server holds the same KV-cache bytes; `--servers`
  picks some;
* each measured with bench/serve.py (closed loop, streamed, ignore_eos), once the machine is quiet again after the
  start (settle(): tokenspout's engine builds its grammar support in a thread right after /health answers): tok/s,
  TTFT and ITL p50 at each concurrency; start-up to a healthy /health and the peak RSS of the server's process tree (start_server.sh);
* one server at a time by default; `--rounds N` (N > 1) starts a family's servers together (each start timed alone),
  then measures every level on each in turn, N rounds with the order reversed every other round, and reports the
  medians (every round kept in the JSON), as bench.compare --rounds: this VM's speed drifts between minutes, and a
  ratio of two servers measured minutes apart carried that drift.  A family's servers must fit in memory together.
Writes bench/results/sizes.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench import serve
from bench.common import write_json
from bench.shapes import SHAPES, make
from tokenspout.config import ACTIVATION_QUANTS

ROOT = Path(__file__).resolve().parent.parent
SLOTS, SLOT_TOKENS = 16, 512


def kv_gib(shape: str) -> float:
    """The GiB of llama.cpp's f16 KV cache for SLOTS x SLOT_TOKENS tokens of this shape."""
    s = SHAPES[shape]
    per_token = s["num_hidden_layers"] * 2 * (s["hidden_size"] // s["num_attention_heads"]) * s["num_key_value_heads"] * 2
    return per_token * SLOTS * SLOT_TOKENS / 2**30


FAMILIES = {"q4_1": "int4", "q8_0": "int8", "q4_k_m": None, "q5_k_m": None}  # llama.cpp's type -> tokenspout's folder quantization


def gguf_files(folder: Path, peers: Path, out: Path, kinds: list[str]) -> dict[str, Path]:
    env = dict(os.environ, PEERS=str(peers))
    src = next((Path(env["PEERS"]) / "llama-src").glob("*/llama.cpp"))
    build = Path(env["PEERS"]) / "llama-build" / "bin"
    bf16 = out / f"{folder.name}-bf16.gguf"
    out.mkdir(parents=True, exist_ok=True)
    if not bf16.is_file():
        subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(folder), "--outtype", "bf16",
                        "--outfile", str(bf16)], check=True, env=dict(env, PYTHONPATH=str(src / "gguf-py")))
    files = {}
    for kind in kinds:
        files[kind] = out / f"{folder.name}-{kind}.gguf"
        if not files[kind].is_file():
            subprocess.run([str(build / "llama-quantize"), str(bf16), str(files[kind]), kind.upper(), "2"], check=True)
    return files


def _busy_jiffies() -> tuple[int, int]:
    """(busy, total) CPU jiffies of the whole machine since boot (/proc/stat)."""
    vals = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = vals[3] + vals[4]  # idle + iowait
    return sum(vals) - idle, sum(vals)


def settle(quiet: float = 0.1, seconds: int = 3, limit_s: float = 120.0) -> float:
    """Waits until the machine's CPUs are at most `quiet` busy for `seconds` consecutive seconds (at most limit_s):
    a server that still works after /health answers (tokenspout's engine builds its grammar support in a thread
    right after READY; a first start may still write caches) must not be measured while it does.  Returns the wait."""
    start = time.monotonic()
    calm = 0
    busy0, tot0 = _busy_jiffies()
    while calm < seconds and time.monotonic() - start < limit_s:
        time.sleep(1.0)
        busy1, tot1 = _busy_jiffies()
        calm = calm + 1 if (busy1 - busy0) <= quiet * max(tot1 - tot0, 1) else 0
        busy0, tot0 = busy1, tot1
    return time.monotonic() - start


def _env() -> dict:
    return dict(os.environ, PEERS=os.environ.get("PEERS", "/tmp/peers"))


def start(name: str, cmd: list[str], port: int, args: argparse.Namespace) -> float:
    """Starts one server (start_server.sh: its log, pid and peak-RSS monitor), waits for a healthy /health and then
    for a quiet machine; returns the start-up time."""
    env = _env()
    res = subprocess.run([str(args.peers_dir / "start_server.sh"), name, f"http://127.0.0.1:{port}/health", "--", *cmd],
                         capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{name} did not start: {res.stdout[-2000:]}{res.stderr[-2000:]}")
    startup = json.loads((Path(env["PEERS"]) / "logs" / f"{name}.startup.json").read_text())["startup_s"]
    settle()
    return startup


def stop(name: str, args: argparse.Namespace) -> float | None:
    """Stops a server; returns the peak RSS (MiB) of its process tree over its life."""
    env = _env()
    subprocess.run([str(args.peers_dir / "stop_server.sh"), name], capture_output=True, text=True, env=env, check=False)
    rss = Path(env["PEERS"]) / "logs" / f"{name}.rss.json"
    return json.loads(rss.read_text()).get("peak_total_rss_mib") if rss.is_file() else None


def load(name: str, port: int, concurrency: list[int], args: argparse.Namespace, extra: list[str]) -> dict:
    """bench.serve against a running server at these concurrency levels (greedy)."""
    sargs = serve.parse_args(["--base-url", f"http://127.0.0.1:{port}/v1", "--model", "bench",
                              "--concurrency", *map(str, concurrency), "--mode", "greedy",
                              "--max-tokens", str(args.max_tokens), "--num-requests", str(args.num_requests),
                              "--label", name, *extra])
    return asyncio.run(serve.run(sargs))


def measure(name: str, cmd: list[str], port: int, args: argparse.Namespace, extra: list[str]) -> dict:
    """One server alone: started, measured at every level, stopped."""
    startup = start(name, cmd, port, args)
    try:
        out = load(name, port, args.concurrency, args, extra)
    finally:
        rss = stop(name, args)
    out["startup_s"] = startup
    out["peak_rss_mib"] = rss
    return out


def measure_rounds(runs: dict, args: argparse.Namespace) -> dict:
    """--rounds: a family's servers (each on its own port) all up at once, each start timed alone on a quiet
    machine; then every level measured on each in turn, round after round (the order reversed every other round),
    the medians reported and every round kept (bench.compare's rounds): this VM's speed drifts 10-40% between
    minutes, and servers measured one after another compared their minutes as much as their code.  The peak RSS
    covers each server's whole life (all rounds)."""
    from bench.compare import interleave, median_row

    up: dict[str, float] = {}
    out: dict = {}
    try:
        for name, (cmd, port, _) in runs.items():
            print(f"== start {name}", flush=True)
            up[name] = start(name, cmd, port, args)
        rows = interleave(list(up), args.rounds, args.concurrency,
                          lambda name, c: load(name, runs[name][1], [c], args, runs[name][2])["results"],
                          lambda c: f"c={c}")
        for name in up:
            out[name] = {"label": name, "results": [median_row(rows[name][c]) for c in args.concurrency],
                         "startup_s": up[name], "rounds": args.rounds}
    finally:
        for name in list(up)[::-1]:
            rss = stop(name, args)
            if name in out:
                out[name]["peak_rss_mib"] = rss
    return out


def table(report: dict) -> str:
    lines = ["| shape / server | " + " | ".join(f"c={c} tok/s (TTFT, ITL p50 ms)" for c in report["concurrency"])
             + " | start s | peak RSS MiB |", "|" + "---|" * (len(report["concurrency"]) + 3)]
    for shape, servers in report["shapes"].items():
        for name, r in servers.items():
            cells = [f"{x['output_tok_s']:.1f} ({x['ttft_p50_ms']:.0f}, {x['itl_p50_ms']:.1f})" for x in r["results"]]
            lines.append(f"| {shape} / {name} | " + " | ".join(cells)
                         + f" | {r['startup_s']:.1f} | {r['peak_rss_mib'] or 0:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["smollm2-1.7b"], choices=sorted(SHAPES))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--servers", nargs="*", default=None,
                    help="only these (llamacpp-q4_1 tokenspout-int4 tokenspout-gguf-q4_1 llamacpp-q8_0 "
                         "tokenspout-int8 tokenspout-gguf-q8_0 llamacpp-q4_k_m tokenspout-gguf-q4_k_m "
                         "llamacpp-q5_k_m tokenspout-gguf-q5_k_m; default: all)")
    ap.add_argument("--out", default="sizes.json", help="results file name under bench/results/")
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES),
                    help="llama.cpp types to make and serve, each with its tokenspout counterparts (default: all)")
    ap.add_argument("--peers-dir", type=Path, default=ROOT.parent / "shared" / "peers")
    ap.add_argument("--activation-quant", nargs="+", default=["int16"], choices=list(ACTIVATION_QUANTS),
                    help="tokenspout's --activation-quant values to serve (int8 rows are named ...-a8)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="N > 1: per family, its servers all up at once and measured in turn, N interleaved rounds "
                         "(medians); the family's servers must fit in memory together")
    args = ap.parse_args()
    from tokenspout.models.default_model import cache_dir

    ts = str(ROOT / ".venv" / "bin" / "tokenspout")
    report: dict = {"concurrency": args.concurrency, "max_tokens": args.max_tokens, "rounds": args.rounds, "shapes": {}}
    peers_dir = Path(os.environ.get("PEERS", "/tmp/peers"))
    for shape in args.shapes:
        import torch

        folder = make(shape, cache_dir() / "shapes" / f"{shape}-bfloat16", torch.bfloat16)
        files = gguf_files(folder, peers_dir, cache_dir() / "shapes" / "gguf", args.families)
        kv = f"{kv_gib(shape):.4f}"
        shutil.rmtree(cache_dir() / "quantized", ignore_errors=True)  # cold: the first start is measured
        groups: list[dict] = []  # per family: name -> (command, port, load generator arguments)
        ports = iter(range(8301, 8400))  # one port per server (in rounds mode a family's servers are up together)
        for kind in args.families:
            ours = FAMILIES[kind]
            runs = {}
            port = next(ports)
            runs[f"llamacpp-{kind}"] = (
                [str(peers_dir / "llama-build" / "bin" / "llama-server"), "-m", str(files[kind]), "--alias", "bench",
                 "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-tb", "2", "-np", str(SLOTS), "-c",
                 str(SLOTS * SLOT_TOKENS), "--no-kv-unified", "-cb"], port, ["--extra-body", '{"repeat_penalty": 1.0}'])
            for aq in args.activation_quant:
                suffix, aq_flag = ("-a8", ["--activation-quant", "int8"]) if aq == "int8" else ("", [])
                if ours is not None:  # (the K-quant mixes have no folder counterpart: the file served directly)
                    port = next(ports)
                    runs[f"tokenspout-{ours}{suffix}"] = (
                        [ts, "serve", str(folder), "--port", str(port), "--quantization", ours, "--kv-cache-memory",
                         kv, "--kv-cache-dtype", "float16", "--served-model-name", "bench", *aq_flag], port, [])
                port = next(ports)
                runs[f"tokenspout-gguf-{kind}{suffix}"] = (
                    [ts, "serve", str(files[kind]), "--port", str(port), "--kv-cache-memory", kv, "--kv-cache-dtype",
                     "float16", "--served-model-name", "bench", *aq_flag], port, [])
            groups.append({n: r for n, r in runs.items() if not args.servers or n in args.servers})
        report["shapes"][shape] = {}
        for runs in groups:
            if args.rounds > 1 and runs:
                print(f"== {shape}: {' '.join(runs)}, {args.rounds} rounds", flush=True)
                report["shapes"][shape].update(measure_rounds(runs, args))
                write_json(args.out, report)
                continue
            for name, (cmd, port, extra) in runs.items():
                print(f"== {shape}: {name}", flush=True)
                report["shapes"][shape][name] = measure(name, cmd, port, args, extra)
                write_json(args.out, report)
    print(table(report))
    print("wrote", write_json(args.out, report))


if __name__ == "__main__":
    main()
