"""Beam search with automatic prefix caching on vs off, in one run.

    python -m bench.beam [--width 4] [--prompts 4] [--max-tokens 32] [--reps 3] [--threads N] [--quick]

`LLM.beam_search` sends every running beam of every prompt as a fresh single-token request each step.  Without
prefix caching each of those requests computes its whole prefix (prompt + the beam's tokens so far); with it, the
full blocks of that prefix were computed by an earlier step's request and are reused, so a beam costs at most one
block of tokens (block size 16) per step.  Two in-process engines (multiprocess=False, identical settings but the
flag) run the same search (--prompts prompts from bench.common, --width beams, --max-tokens tokens); the order
alternates between repeats, median of --reps (--quick: 1); each repeat numbers its prompts differently so that it
finds nothing cached by the one before.  Reported per engine: wall seconds, CPU seconds of this
process (with --threads 1, insensitive to other load on a shared machine), prompt tokens the model computed
(tokens looked up minus tokens found cached; the scheduler's prefix-cache counters, which count every sequence it
admits), and whether the best beams are identical with and without caching.  Writes bench/results/beam.json.
"""

from __future__ import annotations

import argparse
import time

from bench.common import median, prompts, write_json


def timed_search(llm, texts: list[str], width: int, max_tokens: int) -> dict:
    kv = llm.client.core.kv
    q0, h0 = kv.stats.queries, kv.stats.hits
    t, c = time.perf_counter(), time.process_time()
    outs = llm.beam_search(texts, width=width, max_tokens=max_tokens)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    return {"wall_s": wall, "cpu_s": cpu, "computed_tokens": (kv.stats.queries - q0) - (kv.stats.hits - h0),
            "cached_tokens": kv.stats.hits - h0,
            "best": [[list(o.token_ids) for o in out.outputs] for out in outs]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--quick", action="store_true", help="1 repeat")
    ap.add_argument("--out", default="beam.json")
    args = ap.parse_args()
    if args.quick:
        args.reps = 1

    from tokenspout import LLM

    engines = {name: LLM(args.model, multiprocess=False, max_model_len=2048, kv_cache_memory=0.5,
                         num_threads=args.threads, enable_prefix_caching=on)
               for name, on in (("off", False), ("on", True))}
    texts = prompts(args.prompts)
    for llm in engines.values():  # warm-up: first-call overheads, and nothing cached that the timed runs reuse
        llm.beam_search(["Warm-up prompt about nothing in particular"], width=args.width, max_tokens=4)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for r in range(args.reps):
        # Each repeat's prompts start differently, so no repeat finds blocks cached by an earlier one.
        rep_texts = [f"({r + 1}) {t}" for t in texts]
        for name in (("off", "on") if r % 2 == 0 else ("on", "off")):
            runs[name].append(timed_search(engines[name], rep_texts, args.width, args.max_tokens))
    for llm in engines.values():
        llm.shutdown()

    same = all(on["best"] == off["best"] for on, off in zip(runs["on"], runs["off"]))
    res = {name: {"wall_s": median([x["wall_s"] for x in v]), "cpu_s": median([x["cpu_s"] for x in v]),
                  "computed_tokens": v[0]["computed_tokens"], "cached_tokens": v[0]["cached_tokens"],
                  "wall_s_runs": [x["wall_s"] for x in v]}
           for name, v in runs.items()}
    speedup = res["off"]["wall_s"] / res["on"]["wall_s"]
    speedup_cpu = res["off"]["cpu_s"] / res["on"]["cpu_s"]
    print(f"beam search: {args.prompts} prompts x width {args.width}, {args.max_tokens} tokens, "
          f"median of {args.reps}")
    print(f"{'prefix caching':>15} {'wall s':>8} {'cpu s':>8} {'computed tok':>13} {'cached tok':>11}")
    for name in ("off", "on"):
        x = res[name]
        print(f"{name:>15} {x['wall_s']:8.2f} {x['cpu_s']:8.2f} {x['computed_tokens']:13d} {x['cached_tokens']:11d}")
    print(f"speed-up {speedup:.2f}x (cpu-time {speedup_cpu:.2f}x); same beams on and off: {same}")
    path = write_json(args.out, {"args": vars(args), "results": res, "speedup": speedup, "speedup_cpu": speedup_cpu,
                                 "same_beams": same})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
