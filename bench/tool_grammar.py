"""Tool-call grammar cost: batch-16 decode throughput under the constrained tool-call grammar, and its compile time.

    python -m bench.tool_grammar [--batch 16] [--max-tokens 64] [--rounds 3] [--ttft-reps 5] [--threads N]
                                 [--check-max-tokens 256] [--quick]

The grammar is the one the hermes tool parser builds (`TOOL_PARSERS["hermes"]().grammar(TOOLS, ...)`, a Lark
grammar for llguidance) for three tools in OpenAI's format (typed properties, enums, a pattern, a nested object, an
array, required keys), passed as `StructuredOutputsParams(grammar=...)`.  One chat prompt: the tools listed in a
Hermes-style system message as Qwen2.5's template writes it (the default model's own template does not render
`tools`), two earlier turns answered with calls, then a request for flights.  16 rows of it with seeds
1000..1015, temperature 1.0, max_tokens 64, ignore_eos off.  Cases:

  baseline   no grammar: free text
  required   hermes grammar, required=True: `<tool_call>\\n{call}\\n</tool_call>` and nothing else
  auto       hermes grammar, required=False: free text; once `<tool_call>` is written (a lazy trigger), the call
  json       for reference: the same calls' anyOf schema as a plain JSON-schema constraint (`json=`), no markers

Rows end on their own (EOS, or the grammar's end), so the cases generate different numbers of tokens and their
batches shrink at different steps: `vs baseline` compares decode tok/s as the cases run, which also credits or
charges each case for its batch occupancy.  The grammar's own cost is isolated as in bench.guided: for the two tool
grammar cases (json too with --match-json: one more run a round), a `plain@case` run of the same prompts and seeds
without a grammar, with ignore_eos and max_tokens set per row to the number of tokens that row generated under the
grammar (a calibration run first, which also compiles and caches every grammar), so both generate exactly the same
tokens per row; `own cost` = 1 - case / plain@case.  All runs are interleaved within each of --rounds rounds (the
order rotates between rounds), median decode tok/s (bench.speculative.timed_generate: tokens after the step at which
the last row got its first token / time from that step to the end); `tok/cpu-s` is the same in this process's CPU
time (with --threads 1, insensitive to other load on a shared machine).  Grammar work in the grammar runs (mask
fill, mask apply, matcher advance) is timed by wrapping the grammar manager's calls.

Validity: every output of the required case (calibration and every round) must parse with
`TOOL_PARSERS["hermes"]().parse(text, final=True)` into at least one complete call to a known tool whose arguments
are a JSON object; the fraction is reported, with the failing texts and whether they were cut off by max_tokens.
Since a 135M model at temperature 1 writes long strings, a further run of the required case with max_tokens
--check-max-tokens (256) shows whether the rows cut off at 64 complete into calls when given room.  For auto: how
many rows wrote the marker and how many a call; json: how many outputs are valid JSON naming a known tool.

Compile time: llguidance compiles of each spec in this process (median of --ttft-reps, each a spec never seen,
the tools plus one optional property with a random name), and first-token latency at batch 1 (max_tokens 1) of a
plain request vs a request whose grammar is new / cached, interleaved, median and p90.  The very first structured
request of the engine also builds the grammar backend; its latency is reported once.  Writes
bench/results/tool_grammar.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import uuid

from bench.common import median, percentile, write_json
from bench.guided import GrammarTimer
from bench.speculative import timed_generate

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "Get the weather forecast for a city, for today and the following days.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Oslo"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7, "description": "Number of days"},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    }},
    {"type": "function", "function": {
        "name": "search_flights",
        "description": "Search flights between two airports on a given date.",
        "parameters": {
            "type": "object",
            "properties": {
                "origin": {"type": "string", "pattern": "^[A-Z]{3}$", "description": "IATA code of the origin"},
                "destination": {"type": "string", "pattern": "^[A-Z]{3}$",
                                "description": "IATA code of the destination"},
                "date": {"type": "string", "description": "Departure date, YYYY-MM-DD"},
                "passengers": {
                    "type": "object",
                    "properties": {"adults": {"type": "integer", "minimum": 1, "maximum": 9},
                                   "children": {"type": "integer", "minimum": 0, "maximum": 9}},
                    "required": ["adults"],
                    "additionalProperties": False,
                },
                "cabin": {"type": "string", "enum": ["economy", "premium_economy", "business", "first"]},
                "nonstop": {"type": "boolean"},
            },
            "required": ["origin", "destination", "date", "passengers"],
            "additionalProperties": False,
        },
    }},
    {"type": "function", "function": {
        "name": "create_event",
        "description": "Add an event to the user's calendar.",
        "parameters": {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "start": {"type": "string", "description": "Start time, ISO 8601"},
                "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 1440},
                "attendees": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                "reminder": {"type": "string", "enum": ["none", "10m", "1h", "1d"]},
            },
            "required": ["title", "start"],
            "additionalProperties": False,
        },
    }},
]
TOOL_NAMES = frozenset(t["function"]["name"] for t in TOOLS)

# Qwen2.5's rendering of `tools` (the Hermes format), as a system message.
_SYSTEM = ("You are a helpful assistant.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
           "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n"
           "</tools>\n\nFor each function call, return a json object with function name and arguments within "
           "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
           "<args-json-object>}}\n</tool_call>")
QUESTION = "Find me flights from Lisbon (LIS) to Oslo (OSL) on 2025-03-14 for two adults and two kids."
# Two earlier turns in which the assistant answered with calls: without them the 135M default model never writes
# `<tool_call>` on its own (0/16 rows), so the auto case would never leave free text.
_EARLIER = [
    {"role": "user", "content": "What's the weather in Paris for the next 3 days?"},
    {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                                     '"unit": "celsius", "days": 3}}\n</tool_call>'},
    {"role": "user", "content": "Put lunch with Ana on my calendar for Friday at noon."},
    {"role": "assistant", "content": '<tool_call>\n{"name": "create_event", "arguments": {"title": "Lunch with '
                                     'Ana", "start": "2025-03-14T12:00:00"}}\n</tool_call>'},
]
CASES = ("baseline", "required", "auto", "json")
GRAMMAR_CASES = CASES[1:]


def messages(tools: list[dict]) -> list[dict]:
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return [{"role": "system", "content": _SYSTEM.format(tools=listing)}, *_EARLIER,
            {"role": "user", "content": QUESTION}]


def fresh_tools() -> list[dict]:
    """TOOLS plus one optional property with a random name: specs the compile cache has never seen."""
    tools = copy.deepcopy(TOOLS)
    tools[0]["function"]["parameters"]["properties"][f"note_{uuid.uuid4().hex[:10]}"] = {"type": "string"}
    return tools


def call_json_schema(tools: list[dict]) -> str:
    """The anyOf call schema the tool grammar embeds (`%json {...}`), as a plain JSON-schema constraint (without
    its x-guidance whitespace setting, which is the backend's default for `json=` anyway)."""
    from tokenspout.tool_parsers.grammar import call_schema

    schema = json.loads(call_schema(tools).removeprefix("%json "))
    schema.pop("x-guidance", None)
    return json.dumps(schema)


def spec(case: str, tools: list[dict]):
    from tokenspout.sampling_params import StructuredOutputsParams
    from tokenspout.tool_parsers import TOOL_PARSERS

    if case == "json":
        return StructuredOutputsParams(json=call_json_schema(tools))
    grammar = TOOL_PARSERS["hermes"]().grammar(tools, required=case == "required", parallel=False,
                                               special_token_ids={})
    return StructuredOutputsParams(grammar=grammar)


def check_call(text: str) -> str | None:
    """None when `text` parses (hermes, final) into at least one complete call to a known tool with JSON-object
    arguments; else what is wrong."""
    from tokenspout.tool_parsers import TOOL_PARSERS

    try:
        found = TOOL_PARSERS["hermes"]().parse(text, final=True).tool_calls()
    except Exception as e:  # noqa: BLE001 - a parser crash is a finding, not a reason to stop the benchmark
        return f"parse raised {type(e).__name__}: {e}"
    calls = [c for c in found if c.complete]  # a final parse also returns a named call cut off by max_tokens
    if not calls:
        return f"no complete call (a cut-off call to {found[0].name!r})" if found else "no complete call"
    for c in calls:
        if c.name not in TOOL_NAMES:
            return f"unknown tool {c.name!r}"
        try:
            args = json.loads(c.arguments)
        except ValueError as e:
            return f"arguments are not JSON: {e}"
        if not isinstance(args, dict):
            return "arguments are not an object"
    return None


def check_json(text: str) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return isinstance(obj, dict) and obj.get("name") in TOOL_NAMES and isinstance(obj.get("arguments"), dict)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ttft-reps", type=int, default=5)
    ap.add_argument("--check-max-tokens", type=int, default=256,
                    help="max_tokens of the extra validity run of the required case (0: skip it)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--match-json", action="store_true", help="a length-matched plain run for json too")
    ap.add_argument("--quick", action="store_true", help="1 round, 3 latency repeats")
    ap.add_argument("--out", default="tool_grammar.json")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.ttft_reps = 1, min(args.ttft_reps, 3)

    from tokenspout import LLM, SamplingParams

    t_bench = time.perf_counter()
    llm = LLM(args.model, multiprocess=False, max_model_len=2048, max_num_seqs=args.batch,
              max_num_batched_tokens=4096, num_threads=args.threads)
    prompt = llm.processor.apply_chat_template(messages(TOOLS))
    texts = [prompt] * args.batch
    seeds = [1000 + i for i in range(args.batch)]
    specs = {c: spec(c, TOOLS) for c in GRAMMAR_CASES}

    def params(case: str, max_tokens: int, seed: int) -> SamplingParams:
        return SamplingParams(temperature=args.temperature, seed=seed, max_tokens=max_tokens,
                              structured_outputs=specs.get(case))

    timed_generate(llm, texts, SamplingParams(temperature=args.temperature, seed=1, max_tokens=8,
                                              ignore_eos=True))  # warm-up: first-call overheads, prefix cache

    # ---- first structured request of the engine: builds the backend, compiles ------------------------------
    first = timed_generate(llm, texts[:1], SamplingParams(
        temperature=args.temperature, seed=1, max_tokens=1,
        structured_outputs=spec("required", fresh_tools())))["first_token_s"]

    # ---- calibration: compiles and caches each grammar; per-row lengths for the plain@case runs ------------
    case_params = {c: [params(c, args.max_tokens, s) for s in seeds] for c in CASES}
    calib = {c: timed_generate(llm, texts, case_params[c]) for c in CASES}
    lengths = {c: [len(t) for t in calib[c]["token_ids"]] for c in CASES}
    matched = [*GRAMMAR_CASES] if args.match_json else ["required", "auto"]
    for c in matched:
        case_params[f"plain@{c}"] = [SamplingParams(temperature=args.temperature, seed=s, max_tokens=n,
                                                    ignore_eos=True) for s, n in zip(seeds, lengths[c])]
    names = [*CASES, *(f"plain@{c}" for c in matched)]

    mgr = llm.client.core.structured.manager
    runs: dict[str, list[dict]] = {n: [] for n in names}
    timers: dict[str, list[GrammarTimer]] = {c: [] for c in GRAMMAR_CASES}
    for r in range(args.rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:  # rotate the order between rounds
            if name in GRAMMAR_CASES:
                with GrammarTimer(mgr) as gt:
                    res = timed_generate(llm, texts, case_params[name])
                timers[name].append(gt)
            else:
                res = timed_generate(llm, texts, case_params[name])
            runs[name].append(res)
    reproduced = {c: all([len(t) for t in x["token_ids"]] == lengths[c] for x in runs[c]) for c in CASES}
    tps = {n: median([x["decode_tok_s"] for x in v]) for n, v in runs.items()}
    tps_cpu = {n: median([x["decode_tok_cpu_s"] for x in v]) for n, v in runs.items()}
    e2e = {n: median([x["e2e_tok_s"] for x in v]) for n, v in runs.items()}
    vs_base = {n: tps[n] / tps["baseline"] for n in names}
    own_cost = {c: 1 - tps[c] / tps[f"plain@{c}"] for c in matched}
    own_cost_cpu = {c: 1 - tps_cpu[c] / tps_cpu[f"plain@{c}"] for c in matched}
    work = {}
    for c in GRAMMAR_CASES:
        t = {k: sum(g.t[k] for g in timers[c]) for k in timers[c][0].t}
        n = {k: sum(g.calls[k] for g in timers[c]) for k in timers[c][0].calls}
        wall = sum(x["tokens"] / x["e2e_tok_s"] for x in runs[c])
        work[c] = {"time_s": t, "calls": n, "wall_s": wall, "share": sum(t.values()) / wall,
                   "fill_ms_per_step": 1e3 * t["grammar_bitmask"] / max(1, n["grammar_bitmask"])}

    # ---- validity of the outputs -------------------------------------------------------------------------------
    outputs = {c: calib[c]["texts"] + [t for x in runs[c] for t in x["texts"]] for c in CASES}
    n_tokens = {c: lengths[c] + [len(t) for x in runs[c] for t in x["token_ids"]] for c in CASES}
    req_fail = [(t, n, why) for t, n in zip(outputs["required"], n_tokens["required"])
                if (why := check_call(t)) is not None]
    auto_calls = sum(check_call(t) is None for t in outputs["auto"])
    auto_marker = sum("<tool_call>" in t for t in outputs["auto"])
    json_ok = sum(check_json(t) for t in outputs["json"])
    base_calls = sum(check_call(t) is None for t in outputs["baseline"])
    n_out = len(outputs["required"])
    req_cut = sum(n >= args.max_tokens for _, n, _ in req_fail)
    long_fail: list[tuple[str, int, str]] = []
    long_lens: list[int] = []
    if args.check_max_tokens:
        long = timed_generate(llm, texts, [params("required", args.check_max_tokens, s) for s in seeds])
        long_lens = [len(t) for t in long["token_ids"]]
        long_fail = [(t, n, why) for t, n in zip(long["texts"], long_lens) if (why := check_call(t)) is not None]

    # ---- compile time: in-process compiles of never-seen specs, and first-token latency at batch 1 ------------
    backend = mgr._backend_or_build()  # built by now (the first structured request)
    compile_ms: dict[str, list[float]] = {c: [] for c in GRAMMAR_CASES}
    for _ in range(args.ttft_reps):
        for c in GRAMMAR_CASES:
            p = spec(c, fresh_tools())
            t = time.perf_counter()
            backend.compile(p)
            compile_ms[c].append(1e3 * (time.perf_counter() - t))
    lat: dict[str, list[float]] = {"plain": []}
    for c in GRAMMAR_CASES:
        lat[f"{c} new"], lat[f"{c} cached"] = [], []
    kinds = list(lat)
    plain1 = SamplingParams(temperature=args.temperature, seed=1, max_tokens=1)
    for i in range(args.ttft_reps):
        k = i % len(kinds)
        for kind in kinds[k:] + kinds[:k]:
            if kind == "plain":
                p1 = plain1
            else:
                c, state = kind.split()
                p1 = SamplingParams(temperature=args.temperature, seed=1, max_tokens=1,
                                    structured_outputs=spec(c, fresh_tools()) if state == "new" else specs[c])
            lat[kind].append(timed_generate(llm, texts[:1], p1)["first_token_s"])
    llm.shutdown()
    elapsed = time.perf_counter() - t_bench

    # ---- report ------------------------------------------------------------------------------------------------
    print(f"\nbatch {args.batch} x one tool-calling chat prompt, temperature {args.temperature} (seeded), max_tokens "
          f"{args.max_tokens}, ignore_eos off; hermes tool grammar, {len(TOOLS)} tools; median of {args.rounds} "
          f"rounds (interleaved)")
    print(f"{'case':<18}{'decode tok/s':>13}{'vs baseline':>12}{'own cost':>10}{'tok/cpu-s':>11}{'e2e tok/s':>11}"
          f"{'tokens/row min/med/max':>24}{'at max':>8}")
    for n in names:
        c = n.removeprefix("plain@")
        lens = lengths[c]
        cost = f"{100 * own_cost[n]:>9.1f}%" if n in own_cost else f"{'':>10}"
        print(f"{n:<18}{tps[n]:>13.1f}{vs_base[n]:>12.2f}{cost}{tps_cpu[n]:>11.1f}{e2e[n]:>11.1f}"
              f"{f'{min(lens)}/{median(lens):.0f}/{max(lens)}':>24}{sum(x == args.max_tokens for x in lens):>8}")
    print("own cost = 1 - decode tok/s / plain@case (same tokens per row, no grammar); in CPU time: "
          + ", ".join(f"{c} {100 * own_cost_cpu[c]:.1f}%" for c in matched))
    for c in GRAMMAR_CASES:
        w = work[c]
        print(f"grammar work, {c}: mask fill {1e3 * w['time_s']['grammar_bitmask']:.0f} ms over "
              f"{w['calls']['grammar_bitmask']} steps ({w['fill_ms_per_step']:.2f} ms/step), mask apply "
              f"{1e3 * w['time_s'].get('apply_grammar_bitmask', 0):.0f} ms, matcher advance "
              f"{1e3 * w['time_s']['accept']:.0f} ms -- {100 * w['share']:.1f}% of its wall time")
    print("row lengths reproduced in every round: " + ", ".join(f"{c} {v}" for c, v in reproduced.items()))
    print(f"\nvalidity ({n_out} outputs per case, calibration + rounds): required parses to >= 1 complete call "
          f"{n_out - len(req_fail)}/{n_out} ({100 * (n_out - len(req_fail)) / n_out:.0f}%); auto wrote a call "
          f"{auto_calls}/{n_out} (marker in {auto_marker}); json valid call {json_ok}/{n_out}; baseline (no "
          f"grammar) wrote a parseable call {base_calls}/{n_out}")
    print(f"  required failures: {len(req_fail)}, of which {req_cut} cut off at max_tokens {args.max_tokens} and "
          f"{len(req_fail) - req_cut} ended on their own")
    for t, n, why in req_fail[:3]:
        print(f"  required FAILED ({why}; {n} tokens{', hit max_tokens' if n >= args.max_tokens else ''}): {t!r}")
    if args.check_max_tokens:
        print(f"required with max_tokens {args.check_max_tokens}: parses to >= 1 complete call "
              f"{len(long_lens) - len(long_fail)}/{len(long_lens)}; tokens/row min {min(long_lens)}, median "
              f"{median(long_lens):.0f}, max {max(long_lens)}")
        for t, n, why in long_fail[:5]:
            print(f"  FAILED ({why}; {n} tokens): {t!r}")
    print(f"sample required output: {calib['required']['texts'][0]!r}")
    print(f"sample auto output:     {calib['auto']['texts'][0]!r}")

    print(f"\ncompile time of a never-seen spec, in process (ms; median / p90 of {args.ttft_reps})")
    for c, v in compile_ms.items():
        print(f"  {c:<10}{median(v):>8.2f}{percentile(v, 90):>8.2f}")
    print(f"first-token latency, batch 1, max_tokens 1 (ms; median / p90 of {args.ttft_reps})")
    print(f"{'request':<18}{'p50':>8}{'p90':>8}{'vs plain':>10}")
    base = median(lat["plain"])
    for k, v in lat.items():
        print(f"{k:<18}{1e3 * median(v):>8.1f}{1e3 * percentile(v, 90):>8.1f}{1e3 * (median(v) - base):>+10.1f}")
    print(f"{'first ever':<18}{1e3 * first:>8.1f}{'':>8}{1e3 * (first - base):>+10.1f}  (builds the grammar backend)")
    print(f"total {elapsed:.0f} s")

    results = {
        "config": {"batch": args.batch, "max_tokens": args.max_tokens, "temperature": args.temperature,
                   "rounds": args.rounds, "ttft_reps": args.ttft_reps, "threads": args.threads, "quick": args.quick,
                   "match_json": args.match_json, "parser": "hermes", "tools": TOOLS, "question": QUESTION,
                   "comparison": "vs baseline: decode tok/s / no-grammar run (natural lengths); own cost: vs "
                                 "plain@case (same prompts/seeds, ignore_eos, max_tokens = the row's grammar length)"},
        "grammars": {c: specs[c].grammar if specs[c].grammar is not None else specs[c].json for c in GRAMMAR_CASES},
        "row_lengths": lengths, "lengths_reproduced": reproduced,
        "decode_tok_s": tps, "ratio_vs_baseline": vs_base, "own_cost": own_cost,
        "decode_tok_per_cpu_s": tps_cpu, "own_cost_cpu_time": own_cost_cpu, "e2e_tok_s": e2e,
        "rounds_decode_tok_s": {n: [x["decode_tok_s"] for x in v] for n, v in runs.items()},
        "grammar_work": work,
        "validity": {"outputs_per_case": n_out, "required_parsed": n_out - len(req_fail),
                     "required_parsed_fraction": (n_out - len(req_fail)) / n_out,
                     "required_failures": [{"text": t, "tokens": n, "why": why} for t, n, why in req_fail],
                     "auto_calls": auto_calls, "auto_marker": auto_marker, "json_valid_calls": json_ok,
                     "required_cut_off": req_cut, "baseline_calls": base_calls,
                     "long_check": {"max_tokens": args.check_max_tokens, "row_lengths": long_lens,
                                    "parsed": len(long_lens) - len(long_fail),
                                    "failures": [{"text": t, "tokens": n, "why": why} for t, n, why in long_fail]}},
        "compile_ms": {c: {"p50": median(v), "p90": percentile(v, 90), "all": v} for c, v in compile_ms.items()},
        "ttft_ms": {k: {"p50": 1e3 * median(v), "p90": 1e3 * percentile(v, 90), "all": [1e3 * x for x in v]}
                    for k, v in lat.items()},
        "ttft_first_structured_ms": 1e3 * first,
        "sample_outputs": {c: calib[c]["texts"][:3] for c in CASES},
        "wall_s": elapsed,
    }
    print("wrote", write_json(args.out, results))


if __name__ == "__main__":
    main()
