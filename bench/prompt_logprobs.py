"""Prompt logprobs benchmark: what scoring the prompt adds to the same prefill.

    python -m bench.prompt_logprobs              # prompts of 256 and 512 tokens, 7 interleaved repeats
    python -m bench.prompt_logprobs --repeats 3

One in-process EngineCore on the float32 default model (prefix caching off, so every run prefills the whole prompt;
budget 512 so a prompt is one step).  Each case is one request with max_tokens 1: the prefill, one sampled token.
Variants: `none` (no prompt logprobs, the baseline), `k0` (the prompt token's logprob and rank) and `k5` (plus the
top-5).  Variants are interleaved within every repeat so machine drift hits them alike; the median wall time per
request is reported with the ratio to `none`.  Results go to bench/results/prompt_logprobs.json.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
from transformers import AutoTokenizer

from bench.common import median, prompts, write_json
from tokenspout.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenspout.core.engine_core import EngineCore
from tokenspout.engine.messages import EngineCoreRequest
from tokenspout.models.default_model import default_model_path
from tokenspout.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

VARIANTS = {"none": None, "k0": 0, "k5": 5}


def _one(core: EngineCore, rid: str, ids: list[int], k: int | None) -> float:
    core.add_request(EngineCoreRequest(rid, ids, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k)))
    t0 = time.perf_counter()
    while core.has_unfinished_requests():
        core.step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(str(path))
    cfg = EngineConfig(model=ModelConfig(model=str(path), max_model_len=2048),
                       cache=CacheConfig(enable_prefix_caching=False, kv_cache_memory_gib=0.25),
                       scheduler=SchedulerConfig(max_num_batched_tokens=max(args.lengths)))
    core = EngineCore(cfg)
    cases = {n: tok(prompts(1, tok, n)[0]).input_ids[:n] for n in args.lengths}
    times: dict[int, dict[str, list[float]]] = {n: {v: [] for v in VARIANTS} for n in cases}
    for n, ids in cases.items():  # warm-up
        for v, k in VARIANTS.items():
            _one(core, f"warm-{n}-{v}", ids, k)
    for r in range(args.repeats):
        for n, ids in cases.items():
            order = list(VARIANTS.items())
            if r % 2:
                order.reverse()  # alternate the order too
            for v, k in order:
                times[n][v].append(_one(core, f"{r}-{n}-{v}", ids, k))
    rows = []
    for n in cases:
        base = median(times[n]["none"])
        for v in VARIANTS:
            m = median(times[n][v])
            rows.append({"prompt_tokens": n, "variant": v, "median_ms": round(m * 1e3, 2),
                         "ratio_vs_none": round(m / base, 3), "runs_ms": [round(x * 1e3, 2) for x in times[n][v]]})
    out = write_json("prompt_logprobs.json", {"threads": torch.get_num_threads(), "repeats": args.repeats,
                                              "results": rows})
    print(f"{'prompt':>7} {'variant':>8} {'median ms':>10} {'vs none':>8}")
    for row in rows:
        print(f"{row['prompt_tokens']:>7} {row['variant']:>8} {row['median_ms']:>10.1f} {row['ratio_vs_none']:>8.3f}")
    print(f"wrote {out}")
    core.shutdown()


if __name__ == "__main__":
    main()
