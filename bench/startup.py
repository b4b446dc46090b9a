"""Start-up time of `tokenspout serve`: process start to the first `GET /health` that answers 200.

    python -m bench.startup [--reps 3] [--quantization auto none] [-- EXTRA SERVE ARGS]

Each run starts `python -m tokenspout.entrypoints.cli serve` (what `make serve` runs) on a free port, polls
/health every 50 ms, records the elapsed seconds and stops the server.  The cache (converted default model, kernels,
quantized weights) is warmed by one untimed run first.  Prints the median per setting.  Writes
bench/results/startup.json.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.common import ROOT, free_port, write_json


def time_to_healthy(quantization: str, extra: list[str], timeout_s: float = 120.0, log: Path | None = None) -> float:
    port = free_port()
    cmd = [sys.executable, "-m", "tokenspout.entrypoints.cli", "serve", "--port", str(port),
           "--quantization", quantization, *extra]
    url = f"http://127.0.0.1:{port}/health"
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - closed below
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    try:
        while time.perf_counter() - t0 < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before it was healthy")
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"not healthy within {timeout_s} s")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its engine process
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if log:
            out.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quantization", nargs="+", default=["auto", "none"])
    p.add_argument("--log-dir", type=Path, default=None, help="keep each run's server log here")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("extra", nargs="*", help="extra `serve` arguments (after --)")
    args = p.parse_args()
    results = {}
    for q in args.quantization:
        time_to_healthy(q, args.extra)  # warm the caches (conversion, kernels, quantized weights)
        times = []
        for i in range(args.reps):
            log = args.log_dir / f"startup-{q}-{i}.log" if args.log_dir else None
            times.append(time_to_healthy(q, args.extra, log=log))
        results[q] = {"median_s": statistics.median(times), "runs_s": times}
        print(f"--quantization {q:5s} median {statistics.median(times):6.2f} s  runs "
              + " ".join(f"{t:.2f}" for t in times), flush=True)
    if not args.no_write:
        write_json("startup.json", {"affinity": sorted(os.sched_getaffinity(0)),
                               "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "results": results})


if __name__ == "__main__":
    main()
