"""Sampler benchmark: median ms per call against HF logits processors and an argmax floor.

    python -m bench.sampler            # batch 1/16/64/256 x vocab 49,152/128,256 (~2-3 min on 2 cores)
    python -m bench.sampler --quick    # batch 1/64 x vocab 128,256
    python -m bench.sampler --knobs    # issue #31's knobs at batch 64 x vocab 128,256 against plain random sampling

Cases: greedy (all rows); random (T 0.8, top_p 0.95, top_k 50); top_p (0.9 only); mixed (rows cycle
greedy / T 0.8 top_p 0.95 top_k 50 / top_p 0.9 / T 0.7 only, every row with repetition 1.1, presence
0.2, frequency 0.1 over 256 previous output tokens, seeds on a quarter of the rows).  Baselines measured
in the same run on the same logits: `torch` = the same sampler without its CPU kernel (sample/ops/rows_cpu.py:
the all-torch path, as on a GPU); `floor` = logits.argmax(-1); `hf` = transformers' Temperature /
TopK / TopP warpers (+ RepetitionPenalty for mixed) + softmax + torch.multinomial, batch-wide settings.

Logits are LLM-like rather than Gaussian: token t gets -s * log(V * u_t + 1) with u_t ~ U(0, 1), a Zipf
law over a random rank order, with s ~ U(1.5, 2.5) per row -- top-1 probability ~0.3 and a 0.9-nucleus
of ~5 to a few hundred tokens, like a trained model's next-token distributions.  (randn logits over
128k tokens are nearly uniform: their top-p set is most of the vocabulary, which no LM produces.)  The
`flat` line shows that worst case (top_p 0.9 on randn logits: the candidate set never covers it, every
row falls back to a full sort) for information.  The sampler mutates logits only at the penalised
tokens, so calls reuse one logits tensor.  Results go to bench/results/sampler.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from tokenspout.sample.metadata import SamplingMetadata
from tokenspout.sample.ops import noise
from tokenspout.sample.ops.candidates import candidates, topk_values
from tokenspout.sample.ops.draw import block_mass, draw_dense, draw_sparse
from tokenspout.sample.ops.topk_topp import TierConfig, dense_probs, truncate
from tokenspout.sample.sampler import Sampler, apply_logits_processors
from tokenspout.sampling_params import SamplingParams
from tokenspout.worker.sampling_state import SamplingState

RESULTS = Path(__file__).parent / "results" / "sampler.json"
RANDOM = {"temperature": 0.8, "top_p": 0.95, "top_k": 50}


def timeit(fn: Callable[[], object], budget_s: float = 0.4, min_reps: int = 3, max_reps: int = 25) -> float:
    """Median ms per call after one warm-up; repeats until `budget_s` is spent (at least min_reps)."""
    return interleaved({"f": fn}, budget_s, min_reps, max_reps)["f"]


def interleaved(
    fns: dict[str, Callable[[], object]], budget_s: float = 0.6, min_rounds: int = 5, max_rounds: int = 40
) -> dict[str, float]:
    """Median ms per call of each function, measured in alternating rounds (one call of each per round)
    after a warm-up, so that a slow spell on this shared machine hits all of them alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    start = time.perf_counter()
    rounds = 0
    while rounds < max_rounds and (rounds < min_rounds or time.perf_counter() - start < budget_s):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        rounds += 1
    out = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out.update({f"{k}_min": min(v) * 1e3 for k, v in times.items()})  # the least disturbed call
    return out


def keep_freed_memory() -> bool:
    """Asks glibc to keep freed blocks instead of returning each block over 32 MiB to the OS.

    By default every [256, 128k] float32 temporary (131 MB) is a fresh mmap whose pages fault in one by
    one on first touch -- ~100 ms per tensor on this VM, more than the arithmetic.  Ours, HF's and the
    model runner's temporaries all pay it, so a server should run like this (MALLOC_MMAP_THRESHOLD_ /
    MALLOC_TRIM_THRESHOLD_ in the environment, or this call at start-up); `--default-malloc` measures
    without it."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 31))


def cpu_idle(interval: float = 1.0) -> float | None:
    """Fraction of CPU time idle over `interval` seconds (Linux /proc/stat), None elsewhere."""
    def snap() -> tuple[int, int] | None:
        try:
            vals = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        return sum(vals), vals[3] + vals[4]

    a = snap()
    time.sleep(interval)
    b = snap()
    if a is None or b is None or b[0] == a[0]:
        return None
    return (b[1] - a[1]) / (b[0] - a[0])


def wait_idle(max_wait_s: float, need: float = 0.85) -> float | None:
    """Waits (up to max_wait_s) until the machine is mostly idle: other engineers share it."""
    deadline = time.monotonic() + max_wait_s
    idle = cpu_idle()
    while idle is not None and idle < need and time.monotonic() < deadline:
        idle = cpu_idle()
    return idle


def llm_like_logits(batch: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    s = torch.rand(batch, 1, generator=gen) + 1.5
    return -s * torch.log(torch.rand(batch, vocab, generator=gen) * vocab + 1)


def case_params(case: str, batch: int, rng: random.Random) -> list[SamplingParams]:
    if case == "greedy":
        return [SamplingParams(temperature=0.0) for _ in range(batch)]
    if case == "random":
        return [SamplingParams(**RANDOM) for _ in range(batch)]
    if case in ("top_p", "flat"):
        return [SamplingParams(top_p=0.9) for _ in range(batch)]
    pen = {"repetition_penalty": 1.1, "presence_penalty": 0.2, "frequency_penalty": 0.1}
    kinds = [{"temperature": 0.0}, RANDOM, {"top_p": 0.9}, {"temperature": 0.7}]
    return [
        SamplingParams(**kinds[i % 4], **pen, seed=rng.randrange(1 << 62) if i % 4 == 1 else None)
        for i in range(batch)
    ]


def hf_pipeline(case: str, history: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    from transformers.generation.logits_process import (
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    procs: list = []
    if case == "mixed":
        procs.append(RepetitionPenaltyLogitsProcessor(1.1))
    if case in ("random", "mixed"):
        procs += [TemperatureLogitsWarper(0.8), TopKLogitsWarper(50), TopPLogitsWarper(0.95)]
    else:
        procs.append(TopPLogitsWarper(0.9))

    def run(logits: torch.Tensor) -> torch.Tensor:
        scores = logits
        for p in procs:
            scores = p(history, scores)
        return torch.multinomial(scores.softmax(-1), 1)

    return run


def tier_counts(logits: torch.Tensor, meta: SamplingMetadata, tiers: TierConfig) -> dict[str, int]:
    x = logits.clone()
    apply_logits_processors(x, meta)
    kept = truncate(x, meta, tiers) if not meta.all_greedy else None
    counts: Counter[str] = Counter()
    if kept is not None:
        for part in kept.sparse:
            counts["sort" if part.k >= logits.shape[1] else f"k{part.k}"] += part.rows.numel()
        for part in kept.dense:
            counts["nucleus" if part.wide_top_p else "dense"] += part.rows.numel()
    return dict(counts)


def bench_case(case: str, batch: int, vocab: int, sampler: Sampler, with_hf: bool,
               torch_sampler: Sampler | None = None) -> dict:
    gen = torch.Generator().manual_seed(batch * 7 + vocab)
    rng = random.Random(batch + vocab)
    logits = torch.randn(batch, vocab, generator=gen) if case == "flat" else llm_like_logits(batch, vocab, gen)
    params = case_params(case, batch, rng)
    history = torch.randint(0, vocab, (batch, 256), generator=gen)
    state = SamplingState(batch, vocab, torch.device("cpu"))
    for i, p in enumerate(params):
        state.add_request(i, p, [], history[i].tolist(), p.seed if p.seed is not None else rng.randrange(1 << 62))
    slots = list(range(batch))
    meta = state.metadata(slots)
    fns = {"ours": lambda: sampler(logits, meta), "floor": lambda: logits.argmax(-1)}
    if torch_sampler is not None:  # the same sampler without the CPU kernel (ops/rows_cpu.py)
        fns["torch"] = lambda: torch_sampler(logits, meta)
    times = interleaved(fns)
    row = {
        "case": case,
        "batch": batch,
        "vocab": vocab,
        "ours_ms": times["ours"],
        "floor_ms": times["floor"],
        "ours_min_ms": times["ours_min"],
        "floor_min_ms": times["floor_min"],
        "metadata_ms": timeit(lambda: state.metadata(slots), budget_s=0.1),
        "tiers": tier_counts(logits, meta, sampler.tiers),
        "loadavg_1min": os.getloadavg()[0],
    }
    if torch_sampler is not None:
        row["torch_path_ms"] = times["torch"]
    if with_hf and case != "greedy":
        hf = hf_pipeline(case, history)
        row["hf_ms"] = timeit(lambda: hf(logits), budget_s=0.3, min_reps=3, max_reps=10)
        row["speedup_vs_hf"] = row["hf_ms"] / row["ours_ms"]
    row["x_floor"] = row["ours_ms"] / row["floor_ms"]
    return row


# Each knob on top of RANDOM (mirostat replaces top-k / top-p, so its row is T 0.8 alone); every row has a 256-token
# history (prompt) that DRY and no_repeat_ngram read.
KNOBS: dict[str, dict] = {
    "typical_p": {"typical_p": 0.9},
    "epsilon_cutoff": {"epsilon_cutoff": 3e-4},
    "eta_cutoff": {"eta_cutoff": 2e-3},
    "top_n_sigma": {"top_n_sigma": 1.5},
    "xtc": {"xtc_probability": 0.5, "xtc_threshold": 0.1},
    "dynatemp": {"dynatemp_range": 0.5},
    "no_repeat_ngram": {"no_repeat_ngram_size": 3},
    "dry": {"dry_multiplier": 0.8},
    "mirostat_2": {"mirostat": 2},
    "mirostat_1": {"mirostat": 1},
    "temperature_only": {"top_k": 0, "top_p": 1.0},  # no knob: the dense path mirostat rows take, for reference
    # Whole rows (no top-k / top-p): the kernel's whole-row warped path, to compare with temperature_only.
    "top_n_sigma_alone": {"top_n_sigma": 1.0, "top_k": 0, "top_p": 1.0},
    "xtc_min_p": {"xtc_probability": 0.5, "min_p": 0.05, "top_k": 0, "top_p": 1.0},
    "thinking_budget": {"thinking_token_budget": 10_000},
}


def knob_rows(batch: int = 64, vocab: int = 128_256, budget_s: float = 3.0) -> list[dict]:
    """ms per decode step (metadata build + sampler + appending the sampled tokens) of a batch where every row uses
    one knob, against plain random sampling (RANDOM) measured interleaved in the same run on the same logits."""
    gen = torch.Generator().manual_seed(31)
    first = llm_like_logits(batch, vocab, gen)
    history = torch.randint(0, 500, (batch, 256), generator=gen).tolist()  # a small alphabet: repeats to find
    sampler = Sampler()

    def step_fn(params: list[SamplingParams], logits: torch.Tensor) -> Callable[[], object]:
        state = SamplingState(batch, vocab, torch.device("cpu"))
        for i, p in enumerate(params):
            if p.thinking_token_budget is not None:
                p.reasoning_end_token_ids = [1, 2]
            if p.uses_dry:
                p.dry_sequence_breaker_ids = [[198], [25]]
            state.add_request(i, p, history[i], [], 1000 + i)
        slots = list(range(batch))

        def run() -> object:
            out = sampler(logits, state.metadata(slots)).sampled_token_ids
            state.append_tokens(slots, [[t] for t in out.tolist()])
            return out
        return run

    base = [SamplingParams(**RANDOM) for _ in range(batch)]
    rows = []
    for name, knob in KNOBS.items():
        kw = ({"temperature": 0.8} if "mirostat" in knob else dict(RANDOM)) | knob
        kw = {k: v for k, v in kw.items() if not (k == "top_k" and v == 0) and not (k == "top_p" and v == 1.0)}
        # Each knob on fresh logits: the sampler edits them in place where a row is penalised (DRY lowers, no-repeat
        # bans the tokens it drew), and after hundreds of steps those edits would reshape every later knob's rows.
        logits = first.clone()
        times = interleaved({"plain": step_fn(base, logits),
                             name: step_fn([SamplingParams(**kw) for _ in range(batch)], logits)}, budget_s=budget_s)
        rows.append({"knob": name, "params": kw, "batch": batch, "vocab": vocab, "plain_ms": times["plain"],
                     "knob_ms": times[name], "ratio": times[name] / times["plain"],
                     "ratio_min": times[f"{name}_min"] / times["plain_min"], "loadavg_1min": os.getloadavg()[0]})
        print(f"{name:>16} {rows[-1]['plain_ms']:8.2f} {rows[-1]['knob_ms']:8.2f} {rows[-1]['ratio']:6.2f}x "
              f"(min-based {rows[-1]['ratio_min']:5.2f}x)  load {rows[-1]['loadavg_1min']:.2f}", flush=True)
    return rows


def components(vocab: int = 128_256) -> dict[str, float]:
    """Costs behind the design choices, [64, vocab] float32 rows unless the name says otherwise."""
    gen = torch.Generator().manual_seed(0)
    x = llm_like_logits(64, vocab, gen)
    keys = noise.row_keys(torch.arange(64), torch.zeros(64, dtype=torch.int64))
    ids = torch.arange(vocab).expand(1, vocab)
    nb = -(-vocab // 256)
    temp = torch.full((64,), 0.8)
    y, p = dense_probs(x, temp, None)
    mass = block_mass(p, 256)
    cand_y, cand_ids = candidates(x, 128, temp)
    return {
        "argmax": timeit(lambda: x.argmax(-1)),
        "amax": timeit(lambda: x.amax(-1)),
        "torch_topk128": timeit(lambda: x.topk(128, -1)),
        "pooled_topk128": timeit(lambda: topk_values(x, 128)),
        "softmax": timeit(lambda: x.softmax(-1)),
        "dense_probs+block_mass": timeit(lambda: block_mass(dense_probs(x, temp, None)[1], 256)),
        "draw_dense": timeit(lambda: draw_dense(y, mass, keys, 256)),
        "draw_sparse_128cands": timeit(lambda: draw_sparse(cand_ids, cand_y, keys, vocab, 256)),
        "sort_1row": timeit(lambda: x[:1].sort(dim=-1, descending=True)),
        "topk1024_1row": timeit(lambda: topk_values(x[:1], 1024)),
        "topk8192_1row": timeit(lambda: x[:1].topk(8192, -1)),
        "hash_full_vocab_1row": timeit(lambda: noise.gumbel(keys[:1], ids, noise.SALT_TOKEN)),
        "hash_blocks_64rows": timeit(lambda: noise.gumbel(keys, torch.arange(nb).expand(64, nb), noise.SALT_BLOCK)),
        "hash_128cands_64rows": timeit(lambda: noise.gumbel(keys, torch.arange(128).expand(64, 128), 1)),
        "torch_exponential_": timeit(lambda: torch.empty(64, vocab).exponential_()),
        "rand_log_neg": timeit(lambda: torch.rand(64, vocab).log_().neg_()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="batch 1 and 64, vocab 128,256 only")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--default-malloc", action="store_true", help="leave glibc's allocator thresholds alone")
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                    help="before each case wait up to S seconds for the shared CPU to be >= 85%% idle")
    ap.add_argument("--batches", type=int, nargs="+", help="override the batch sizes")
    ap.add_argument("--out", type=Path, default=RESULTS, help=f"JSON results (default {RESULTS})")
    ap.add_argument("--vocabs", type=int, nargs="+", help="override the vocabulary sizes")
    ap.add_argument("--knobs", action="store_true", help="only issue #31's knob rows (bench/results/sampler_knobs.json "
                    "unless --out)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    tuned = False if args.default_malloc else keep_freed_memory()
    if args.knobs:
        print(f"{'knob':>16} {'plain ms':>8} {'knob ms':>8} {'ratio':>7}   (batch 64, vocab 128,256, per decode step)")
        out = args.out if args.out != RESULTS else RESULTS.with_name("sampler_knobs.json")
        # Three runs, the median ratio per knob: this machine is shared, a single run moves by ~30%.
        runs = [knob_rows() for _ in range(3)]
        summary = [{"knob": r["knob"], "ratios": [run[i]["ratio"] for run in runs],
                    "median_ratio": statistics.median(run[i]["ratio"] for run in runs),
                    "plain_ms": statistics.median(run[i]["plain_ms"] for run in runs),
                    "knob_ms": statistics.median(run[i]["knob_ms"] for run in runs)} for i, r in enumerate(runs[0])]
        for r in summary:
            print(f"{r['knob']:>16} median ratio {r['median_ratio']:.2f}x  (runs: "
                  f"{', '.join(f'{x:.2f}' for x in r['ratios'])})")
        out.write_text(json.dumps({"machine": {"platform": platform.platform(), "threads": torch.get_num_threads(),
                                               "torch": torch.__version__}, "summary": summary, "runs": runs},
                                  indent=1))
        print(f"wrote {out}")
        return
    batches = args.batches or ((1, 64) if args.quick else (1, 16, 64, 256))
    vocabs = args.vocabs or ((128_256,) if args.quick else (49_152, 128_256))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, glibc keeps freed memory: {tuned}")
    sampler = Sampler()
    torch_sampler = Sampler(cpu_kernel=False) if sampler._lib is not None else None
    rows = []
    print(f"{'case':>7} {'batch':>5} {'vocab':>7} {'ours ms':>8} {'torch ms':>8} {'floor ms':>8} {'x floor':>7} "
          f"{'hf ms':>8} {'hf/ours':>7} {'meta ms':>7} {'load':>5}  tiers")
    for vocab in vocabs:
        for batch in batches:
            cases = ["greedy", "random", "top_p", "mixed"]
            if batch == 16 and vocab == 128_256:
                cases.append("flat")
            for case in cases:
                idle = wait_idle(args.wait_idle) if args.wait_idle else None
                r = bench_case(case, batch, vocab, sampler, not args.no_hf, torch_sampler)
                r["idle_before"] = idle
                rows.append(r)
                hf = f"{r['hf_ms']:8.2f} {r['speedup_vs_hf']:7.1f}" if "hf_ms" in r else f"{'-':>8} {'-':>7}"
                tp = f"{r['torch_path_ms']:8.2f}" if "torch_path_ms" in r else f"{'-':>8}"
                print(f"{case:>7} {batch:>5} {vocab:>7} {r['ours_ms']:8.2f} {tp} {r['floor_ms']:8.2f} "
                      f"{r['x_floor']:7.2f} {hf} {r['metadata_ms']:7.3f} {r['loadavg_1min']:5.2f}  {r['tiers']}",
                      flush=True)
    if args.wait_idle:
        wait_idle(args.wait_idle)
    comp = components()
    print("components (ms, [64, 128256] unless noted):", {k: round(v, 3) for k, v in comp.items()})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": {"platform": platform.platform(), "threads": torch.get_num_threads(), "torch": torch.__version__},
        "quick": args.quick,
        "malloc_keeps_freed_memory": tuned,
        "results": rows,
        "components": comp,
    }, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
