"""Sampler benchmark: median ms per call against HF logits processors and an argmax floor.

    python -m bench.sampler            # batch 1/16/64/256 x vocab 49,152/128,256 (~2-3 min on 2 cores)
    python -m bench.sampler --quick    # batch 1/64 x vocab 128,256

Cases: greedy (all rows); random (T 0.8, top_p 0.95, top_k 50); top_p (0.9 only); mixed (rows cycle
greedy / T 0.8 top_p 0.95 top_k 50 / top_p 0.9 / T 0.7 only, every row with repetition 1.1, presence
0.2, frequency 0.1 over 256 previous output tokens, seeds on a quarter of the rows).  Baselines measured
in the same run on the same logits: `floor` = logits.argmax(-1); `hf` = transformers' Temperature /
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
import json
import platform
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from tokenspout.sample.metadata import SamplingMetadata, SamplingState
from tokenspout.sample.ops import noise
from tokenspout.sample.ops.topk_topp import TierConfig, truncate
from tokenspout.sample.sampler import Sampler, apply_logits_processors
from tokenspout.sampling_params import SamplingParams

RESULTS = Path(__file__).parent / "results" / "sampler.json"
RANDOM = {"temperature": 0.8, "top_p": 0.95, "top_k": 50}


def timeit(fn: Callable[[], object], budget_s: float = 0.4, min_reps: int = 3, max_reps: int = 25) -> float:
    """Median ms per call after one warm-up; repeats until `budget_s` is spent (at least min_reps)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


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
            counts[("first", "second", "sort")[part.tier]] += part.rows.numel()
        if kept.dense is not None:
            counts["dense"] += kept.dense.rows.numel()
    return dict(counts)


def bench_case(case: str, batch: int, vocab: int, sampler: Sampler, with_hf: bool) -> dict:
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
    row = {
        "case": case,
        "batch": batch,
        "vocab": vocab,
        "ours_ms": timeit(lambda: sampler(logits, meta)),
        "floor_ms": timeit(lambda: logits.argmax(-1)),
        "metadata_ms": timeit(lambda: state.metadata(slots), budget_s=0.1),
        "tiers": tier_counts(logits, meta, sampler.tiers),
    }
    if with_hf and case != "greedy":
        hf = hf_pipeline(case, history)
        row["hf_ms"] = timeit(lambda: hf(logits), budget_s=0.3)
        row["speedup_vs_hf"] = row["hf_ms"] / row["ours_ms"]
    row["x_floor"] = row["ours_ms"] / row["floor_ms"]
    return row


def components(vocab: int = 128_256) -> dict[str, float]:
    """Costs behind the design choices, [64, vocab] float32 unless said otherwise."""
    gen = torch.Generator().manual_seed(0)
    x = llm_like_logits(64, vocab, gen)
    keys = noise.row_keys(torch.arange(64), torch.zeros(64, dtype=torch.int64))
    ids = torch.arange(vocab).expand(1, vocab)
    nb = -(-vocab // 256)
    return {
        "argmax": timeit(lambda: x.argmax(-1)),
        "topk128": timeit(lambda: x.topk(128, -1)),
        "softmax": timeit(lambda: x.softmax(-1)),
        "sort_1row": timeit(lambda: x[:1].sort(dim=-1, descending=True)),
        "topk8192_1row": timeit(lambda: x[:1].topk(8192, -1)),
        "hash_full_vocab_1row": timeit(lambda: noise.gumbel(keys[:1], ids, noise.SALT_TOKEN)),
        "hash_blocks_64rows": timeit(lambda: noise.gumbel(keys, torch.arange(nb).expand(64, nb), noise.SALT_BLOCK)),
        "hash_128cands_64rows": timeit(lambda: noise.gumbel(keys, torch.arange(128).expand(64, 128), 1)),
        "rand_log_neg": timeit(lambda: torch.rand(64, vocab).log_().neg_()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="batch 1 and 64, vocab 128,256 only")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    args = ap.parse_args()
    torch.set_num_threads(2)
    batches = (1, 64) if args.quick else (1, 16, 64, 256)
    vocabs = (128_256,) if args.quick else (49_152, 128_256)
    sampler = Sampler()
    rows = []
    print(f"{'case':>7} {'batch':>5} {'vocab':>7} {'ours ms':>8} {'floor ms':>8} {'x floor':>7} "
          f"{'hf ms':>8} {'hf/ours':>7} {'meta ms':>7}  tiers")
    for vocab in vocabs:
        for batch in batches:
            cases = ["greedy", "random", "top_p", "mixed"]
            if batch == 16 and vocab == 128_256:
                cases.append("flat")
            for case in cases:
                r = bench_case(case, batch, vocab, sampler, not args.no_hf)
                rows.append(r)
                hf = f"{r['hf_ms']:8.2f} {r['speedup_vs_hf']:7.1f}" if "hf_ms" in r else f"{'-':>8} {'-':>7}"
                print(f"{case:>7} {batch:>5} {vocab:>7} {r['ours_ms']:8.2f} {r['floor_ms']:8.2f} "
                      f"{r['x_floor']:7.2f} {hf} {r['metadata_ms']:7.3f}  {r['tiers']}", flush=True)
    comp = components()
    print("components (ms, [64, 128256] unless noted):", {k: round(v, 3) for k, v in comp.items()})
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "machine": {"platform": platform.platform(), "threads": torch.get_num_threads(), "torch": torch.__version__},
        "quick": args.quick,
        "results": rows,
        "components": comp,
    }, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
