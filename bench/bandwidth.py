"""How close one decode step of the default model comes to the machine's memory read bandwidth, measured in one run.

    python -m bench.bandwidth [--quantization int4] [--threads 2] [--steps 200] [--out bandwidth.json]

* `read GB/s`: a 1 GiB float32 buffer summed by torch with the engine's threads (median of repeated sums): what
  this VM's memory delivers to a streaming reader today (it drifts ~2x from day to day, hence the same run).
* `decode`: the C decoder's batch-1 step (every decoder layer + final norm + LM head, the engine's kernels at each
  ISA level this CPU has) at position ~100 of a sequence, median over --steps steps; the bytes it must read are the
  packed weights (codes + float16 scales/mins of every linear layer and the LM head) and the step's KV rows.
* `ratio`: (bytes / step time) / read GB/s.  Above ~0.7 a step is bound by memory, not by the kernels' arithmetic.
Writes bench/results/bandwidth.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the engine process runs (set before torch loads libgomp)
import torch

from bench.common import write_json
from tokenspout.config import ModelConfig
from tokenspout.kernels import cpu
from tokenspout.kernels.decoder import CpuDecoder
from tokenspout.models.loader import load_model


def read_bandwidth(gib: float = 1.0, reps: int = 9) -> float:
    buf = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    buf.sum()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return buf.numel() * 4 / statistics.median(times) / 1e9


def weight_bytes(quantized: dict) -> int:
    return sum(t.numel() * t.element_size() for p in quantized.values() for t in p.tensors())


def decode_step_s(lib, loaded, steps: int, context: int = 100, block_size: int = 16) -> float:
    a = loaded.arch
    nb = 64
    kv = [torch.zeros(2, nb * block_size, a.num_kv_heads, a.head_dim) for _ in range(a.num_layers)]
    dec = CpuDecoder(lib, loaded.model, kv, block_size, loaded.quantized)
    block_ids = torch.arange(nb, dtype=torch.int64)[None, :].contiguous()
    ids = torch.tensor([1], dtype=torch.int64)
    times = []
    for i in range(steps + 10):
        pos = torch.tensor([context + i % 50], dtype=torch.int64)
        t0 = time.perf_counter()
        dec.forward_logits(ids, pos, pos.clone(), block_ids, pos + 1)  # (the engine's call for such a step)
        if i >= 10:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", default="int4", choices=["int4", "int8"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default="bandwidth.json", help="file name under bench/results/")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if cpu.load() is None:
        raise SystemExit("the C kernels are unavailable on this machine")
    loaded = load_model(ModelConfig(dtype="float32", quantization=args.quantization))
    assert loaded.quantized is not None
    wbytes = weight_bytes(loaded.quantized)
    a = loaded.arch
    kv_bytes = a.num_layers * 2 * 125 * a.num_kv_heads * a.head_dim * 4  # ~125 positions of float32 K and V
    report: dict = {"threads": torch.get_num_threads(), "quantization": args.quantization,
                    "weight_bytes": wbytes, "kv_bytes": kv_bytes, "rounds": []}
    for _ in range(3):  # interleaved: bandwidth, then each ISA level, three times
        bw = read_bandwidth()
        row: dict = {"read_gb_s": round(bw, 2)}
        for isa in cpu.available_isas():
            s = decode_step_s(cpu.load(isa), loaded, args.steps)
            row[isa] = {"step_ms": round(s * 1e3, 3), "gb_s": round((wbytes + kv_bytes) / s / 1e9, 2),
                        "ratio": round((wbytes + kv_bytes) / s / 1e9 / bw, 3)}
        report["rounds"].append(row)
        print(row, flush=True)
    med = {"read_gb_s": statistics.median(r["read_gb_s"] for r in report["rounds"])}
    for isa in cpu.available_isas():
        med[isa] = {k: statistics.median(r[isa][k] for r in report["rounds"]) for k in ("step_ms", "gb_s", "ratio")}
    report["median"] = med
    print(f"weights {wbytes / 1e6:.1f} MB/step; read bandwidth {med['read_gb_s']:.1f} GB/s")
    for isa in cpu.available_isas():
        m = med[isa]
        print(f"{isa:7s} step {m['step_ms']:.2f} ms  {m['gb_s']:.1f} GB/s  = {m['ratio']:.2f}x read bandwidth")
    print("wrote", write_json(args.out, report))


if __name__ == "__main__":
    main()
