"""Structured output (JSON-schema grammar) cost: batch-16 decode throughput and first-token latency, in one run.

    python -m bench.guided [--batch 16] [--max-tokens 128] [--reps 3] [--ttft-reps 10] [--threads N] [--quick]

Throughput: 16 chat prompts asking for a JSON profile of a fictional person, temperature 1.0, seeded per row,
max_tokens 128.  `grammar`: every row carries the same moderately nested schema (strings with maxLength,
bounded integers, a nested object, an array of 1-3 small objects, additionalProperties false), so outputs end
on their own when the object closes -- rows finish at different steps, most before max_tokens.  `plain`: the
same prompts and seeds without a grammar, with ignore_eos and max_tokens set per row to the number of tokens
that row generated under the grammar (measured in a calibration run first).  So both runs generate exactly the
same tokens per row and the batch shrinks at the same steps, and the only difference is the grammar work: mask
computation, mask application in the sampler, advancing the matcher.  (Comparing against plain rows that all
run to 128 tokens would credit the plain run with a fuller batch for longer and overstate the cost.)  The
schema is compiled once in the calibration run and cached afterwards, so this measures steady-state decoding;
compile cost shows in the latency part.  decode tok/s = tokens after the step at which the last row got its
first token / time from that step to the end (see bench.speculative.timed_generate); the order of the two runs
alternates between repeats, median of --reps (--quick: 1); `tok/cpu-s` is the same in this process's CPU time
(with --threads 1, insensitive to other load on a shared machine).  Target: the grammar costs <= 15% throughput.

First-token latency at batch 1 (max_tokens 1, same in-process engine): a plain request; a request whose schema
is new each time (the throughput schema plus a property with a random name, so the compile cache misses); and
one whose schema is cached (the throughput schema).  Interleaved, median (and p90) of --ttft-reps.  The very first
structured request of the engine also builds the grammar backend (llguidance's tokenizer index); its latency is
reported once, separately.  Where grammar time goes in the throughput run (mask fill, matcher advance) is
measured by timing the grammar manager's calls.  Writes bench/results/guided.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import uuid
from typing import Self

from bench.common import median, percentile, write_json
from bench.speculative import chat, timed_generate

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "occupation": {"type": "string", "minLength": 1, "maxLength": 24},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "minLength": 1, "maxLength": 28},
                "city": {"type": "string", "minLength": 1, "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "skills": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {"skill": {"type": "string", "minLength": 1, "maxLength": 16},
                               "level": {"type": "integer", "minimum": 1, "maximum": 5}},
                "required": ["skill", "level"],
                "additionalProperties": False,
            },
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "occupation", "address", "skills", "active"],
    "additionalProperties": False,
}

_JOBS = ["baker", "pilot", "nurse", "carpenter", "astronomer", "librarian", "chef", "mechanic", "teacher",
         "gardener", "architect", "journalist", "violinist", "firefighter", "programmer", "beekeeper"]
_PLACES = ["Lisbon", "Osaka", "Nairobi", "Toronto", "Oslo", "Lima", "Cairo", "Perth"]


def guided_messages(n: int) -> list[str]:
    return [f"Create a JSON profile of a fictional {_JOBS[i % len(_JOBS)]} who lives in {_PLACES[i % len(_PLACES)]}: "
            f"name, age, occupation, address (street, city, zip), up to three skills with a level from 1 to 5, "
            f"and whether they are active." for i in range(n)]


def fresh_schema() -> str:
    """The throughput schema plus one property with a random name: a spec the compile cache has never seen."""
    s = copy.deepcopy(SCHEMA)
    s["properties"][f"note_{uuid.uuid4().hex[:10]}"] = {"type": "string", "maxLength": 12}
    return json.dumps(s)


class GrammarTimer:
    """Times the grammar work of each step by wrapping the grammar manager's per-step calls (mask fill, matcher
    advance, end check) and the sampler's mask application."""

    def __init__(self, mgr) -> None:
        from tokenspout.sample import sampler

        self.targets = [(mgr, n) for n in ("grammar_bitmask", "accept", "should_end")]
        if hasattr(sampler, "apply_grammar_bitmask"):
            self.targets.append((sampler, "apply_grammar_bitmask"))
        self.saved: dict[str, object] = {}
        self.t = {n: 0.0 for _, n in self.targets}
        self.calls = {n: 0 for _, n in self.targets}

    def __enter__(self) -> Self:
        for obj, name in self.targets:
            fn = getattr(obj, name)
            self.saved[name] = fn

            def wrapped(*a, _fn=fn, _name=name, **kw):
                t = time.perf_counter()
                try:
                    return _fn(*a, **kw)
                finally:
                    self.t[_name] += time.perf_counter() - t
                    self.calls[_name] += 1

            setattr(obj, name, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        for obj, name in self.targets:
            if isinstance(obj, type(time)):  # a module: put the function back
                setattr(obj, name, self.saved[name])
            else:
                delattr(obj, name)  # an instance: back to its class's method


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ttft-reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--quick", action="store_true", help="1 throughput repeat, 5 latency repeats")
    ap.add_argument("--out", default="guided.json")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.ttft_reps = 1, min(args.ttft_reps, 5)

    from tokenspout import LLM, SamplingParams
    from tokenspout.sampling_params import StructuredOutputsParams

    llm = LLM(args.model, multiprocess=False, max_model_len=2048, max_num_seqs=args.batch,
              max_num_batched_tokens=4096, num_threads=args.threads)
    texts = chat(llm, guided_messages(args.batch))
    schema = json.dumps(SCHEMA)
    seeds = [1000 + i for i in range(args.batch)]

    def grammar_params(spec: str, max_tokens: int, seed: int) -> SamplingParams:
        return SamplingParams(temperature=args.temperature, seed=seed, max_tokens=max_tokens,
                              structured_outputs=StructuredOutputsParams(json=spec))

    plain_warm = SamplingParams(temperature=args.temperature, seed=1, max_tokens=8, ignore_eos=True)
    timed_generate(llm, texts, plain_warm)  # warm-up: first-call overheads

    # ---- first structured request of the engine: builds the backend, compiles ------------------------------
    first = timed_generate(llm, texts[:1], grammar_params(fresh_schema(), 1, 1))["first_token_s"]

    # ---- throughput: calibration (compiles and caches SCHEMA; per-row lengths), then interleaved repeats ----
    g_params = [grammar_params(schema, args.max_tokens, s) for s in seeds]
    calib = timed_generate(llm, texts, g_params)
    lengths = [len(t) for t in calib["token_ids"]]
    p_params = [SamplingParams(temperature=args.temperature, seed=s, max_tokens=n, ignore_eos=True)
                for s, n in zip(seeds, lengths)]
    valid = 0
    for text in calib["texts"]:
        try:
            json.loads(text)
            valid += 1
        except ValueError:
            pass
    mgr = llm.client.core.structured.manager
    runs: dict[str, list[dict]] = {"plain": [], "grammar": []}
    timers: list[GrammarTimer] = []
    for r in range(args.reps):
        for name in (("plain", "grammar") if r % 2 == 0 else ("grammar", "plain")):
            if name == "grammar":
                with GrammarTimer(mgr) as gt:
                    res = timed_generate(llm, texts, g_params)
                timers.append(gt)
                res["decode_s"] = (res["tokens"] - len(texts)) / res["decode_tok_s"]
            else:
                res = timed_generate(llm, texts, p_params)
            runs[name].append(res)
    assert all([len(t) for t in x["token_ids"]] == lengths for x in runs["plain"])
    same_lengths = all([len(t) for t in x["token_ids"]] == lengths for x in runs["grammar"])
    tps = {k: median([x["decode_tok_s"] for x in v]) for k, v in runs.items()}
    tps_cpu = {k: median([x["decode_tok_cpu_s"] for x in v]) for k, v in runs.items()}
    cost = 1 - tps["grammar"] / tps["plain"]
    cost_cpu = 1 - tps_cpu["grammar"] / tps_cpu["plain"]
    steps_t = {k: sum(t.t[k] for t in timers) for k in timers[0].t}
    n_calls = {k: sum(t.calls[k] for t in timers) for k in timers[0].calls}
    total_s = sum(x["tokens"] / x["e2e_tok_s"] for x in runs["grammar"])

    # ---- first-token latency at batch 1 -------------------------------------------------------------------------
    lat: dict[str, list[float]] = {"plain": [], "new schema": [], "cached schema": []}
    plain1 = SamplingParams(temperature=args.temperature, seed=1, max_tokens=1)
    kinds = list(lat)
    for i in range(args.ttft_reps):
        for kind in kinds[i % 3:] + kinds[: i % 3]:  # rotate the order
            params = (plain1 if kind == "plain" else
                      grammar_params(fresh_schema() if kind == "new schema" else schema, 1, 1))
            lat[kind].append(timed_generate(llm, texts[:1], params)["first_token_s"])
    llm.shutdown()

    print(f"\nbatch {args.batch}, temperature {args.temperature} (seeded), max_tokens {args.max_tokens}; grammar rows "
          f"end when the JSON closes, plain rows are cut to the same per-row lengths (ignore_eos); median of "
          f"{args.reps}")
    print(f"tokens per row: min {min(lengths)}, median {median(lengths):.0f}, max {max(lengths)}, "
          f"{sum(n == args.max_tokens for n in lengths)} hit max_tokens; valid JSON {valid}/{len(lengths)}")
    print(f"{'case':<10}{'decode tok/s':>14}{'e2e tok/s':>11}{'tok/cpu-s':>11}")
    for k in ("plain", "grammar"):
        print(f"{k:<10}{tps[k]:>14.1f}{median([x['e2e_tok_s'] for x in runs[k]]):>11.1f}{tps_cpu[k]:>11.1f}")
    print(f"grammar cost: {100 * cost:.1f}% of decode throughput (target <= 15%: "
          f"{'met' if cost <= 0.15 else 'NOT met'}); in CPU time: {100 * cost_cpu:.1f}%")
    fill, n_fill = steps_t["grammar_bitmask"], max(1, n_calls["grammar_bitmask"])
    print(f"grammar work in the grammar runs: mask fill {1e3 * fill:.0f} ms over {n_fill} steps "
          f"({1e3 * fill / n_fill:.2f} ms/step), mask apply {1e3 * steps_t.get('apply_grammar_bitmask', 0):.0f} ms, "
          f"matcher advance {1e3 * steps_t['accept']:.0f} ms, end checks {1e3 * steps_t['should_end']:.0f} ms -- "
          f"{100 * sum(steps_t.values()) / total_s:.1f}% of their wall time; grammar lengths reproduced in every "
          f"repeat: {same_lengths}")
    print(f"\nfirst-token latency, batch 1, max_tokens 1 (ms; median / p90 of {args.ttft_reps})")
    print(f"{'request':<16}{'p50':>8}{'p90':>8}{'vs plain':>10}")
    base = median(lat["plain"])
    for k, v in lat.items():
        print(f"{k:<16}{1e3 * median(v):>8.1f}{1e3 * percentile(v, 90):>8.1f}{1e3 * (median(v) - base):>+10.1f}")
    print(f"{'first ever':<16}{1e3 * first:>8.1f}{'':>8}{1e3 * (first - base):>+10.1f}  (builds the grammar backend)")

    results = {
        "config": {"batch": args.batch, "max_tokens": args.max_tokens, "temperature": args.temperature,
                   "reps": args.reps, "ttft_reps": args.ttft_reps, "threads": args.threads, "quick": args.quick,
                   "schema": SCHEMA,
                   "comparison": "plain rows: same prompts/seeds, ignore_eos, max_tokens = the row's grammar length"},
        "row_lengths": lengths, "grammar_lengths_reproduced": same_lengths, "valid_json": valid,
        "decode_tok_s": tps, "grammar_cost": cost,
        "decode_tok_per_cpu_s": tps_cpu, "grammar_cost_cpu_time": cost_cpu, "target_cost": 0.15,
        "reps_decode_tok_s": {k: [x["decode_tok_s"] for x in v] for k, v in runs.items()},
        "e2e_tok_s": {k: median([x["e2e_tok_s"] for x in v]) for k, v in runs.items()},
        "grammar_time_s": steps_t, "grammar_calls": n_calls, "grammar_run_wall_s": total_s,
        "ttft_ms": {k: {"p50": 1e3 * median(v), "p90": 1e3 * percentile(v, 90), "all": [1e3 * x for x in v]}
                    for k, v in lat.items()},
        "ttft_first_structured_ms": 1e3 * first,
        "sample_output": calib["texts"][0],
    }
    print("wrote", write_json(args.out, results))


if __name__ == "__main__":
    main()
