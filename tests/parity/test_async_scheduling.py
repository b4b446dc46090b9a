"""Async scheduling (SchedulerConfig.async_scheduling): step N+1 is scheduled and prepared while step N runs, its
inputs taking step N's sampled ids from the output tensor.  The oracle is the synchronous engine: every request
ends with the same tokens, logprobs and finish reason, through early stops, aborts, preemption and the batches
that must step synchronously (grammars, guidance)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import make_core
from tokenspout.engine.messages import EngineCoreRequest
from tokenspout.sampling_params import SamplingParams, StructuredOutputsParams

PROMPTS = ["The capital of France is", "Hi", "Write a haiku about the sea.", "1, 2, 3, 4, 5,",
           "def fibonacci(n):\n", "Translate to French: The weather is nice today."]


def _record(core) -> list[str]:
    """Logs 'prepare' / 'update' as the engine calls them: how far scheduling ran ahead of the results."""
    events: list[str] = []
    prepare, update = core.runner.prepare, core.scheduler.update_from_output

    def prep(sched):
        if not sched.is_empty:
            events.append("prepare")
        return prepare(sched)

    def upd(sched, result):
        if not sched.is_empty:
            events.append("update")
        return update(sched, result)

    core.runner.prepare, core.scheduler.update_from_output = prep, upd
    return events


def _run(core, prompts, params, abort_at: dict[int, list[str]] | None = None, max_steps: int = 2000):
    """Steps to the end; returns {request id: (tokens, logprobs, finish reason)}.  abort_at: step -> ids aborted
    before that step (between steps, i.e. while a step is in flight with async scheduling)."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, plist)):
        core.add_request(EngineCoreRequest(str(i), p, sp))
    out = {str(i): ([], [], None) for i in range(len(prompts))}
    aborted: set[str] = set()
    for step in range(max_steps):
        if abort_at and step in abort_at:
            core.abort_requests(abort_at[step])
            aborted.update(abort_at[step])
        if not core.has_unfinished_requests():
            break
        for o in core.step().outputs:
            toks, lps, reason = out[o.request_id]
            assert reason is None, "output after the request finished"
            assert o.request_id not in aborted, "output of an aborted request"
            toks.extend(o.new_token_ids)
            lps.extend((lp.logprob, lp.top_token_ids, lp.top_logprobs) for lp in o.new_logprobs or ())
            out[o.request_id] = (toks, lps, o.finish_reason)
    assert not core.has_unfinished_requests()
    return out


def _ids(tokenizer, prompts=PROMPTS):
    return [tokenizer(p).input_ids for p in prompts]


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for rid, (ta, la, ra) in a.items():
        tb, lb, rb = b[rid]
        assert ta == tb and ra == rb, rid
        assert len(la) == len(lb)
        for (x, ix, vx), (y, iy, vy) in zip(la, lb):
            assert ix == iy and abs(x - y) < 1e-4 and max((abs(p - q) for p, q in zip(vx, vy)), default=0) < 1e-4


def _released(core) -> None:
    """Every block back in the pool, and (after one more, empty step) every row and its sampling state."""
    core.step()
    assert core.kv.num_free_blocks == core.kv.num_blocks
    assert not core.runner.input_batch.row_of and all(s is None for s in core.runner.input_batch.sampling._slots)


def test_same_outputs_as_sync_with_early_stops(loaded_model, tokenizer):
    ids = _ids(tokenizer)
    period = tokenizer(".").input_ids[-1]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=11, max_tokens=9, logprobs=3),
        SamplingParams(temperature=1.0, seed=5, max_tokens=17, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[period]),  # ends early: a wasted step
        SamplingParams(temperature=0.7, min_p=0.05, seed=3, max_tokens=3, min_tokens=2),
        SamplingParams(temperature=0.9, seed=8, max_tokens=20, stop_token_ids=[period, tokenizer(",").input_ids[-1]]),
    ]
    sync = _run(make_core(loaded_model), ids, params)
    core = make_core(loaded_model, async_scheduling=True)
    events = _record(core)
    got = _run(core, ids, params)
    _assert_same(got, sync)
    assert any(r == "stop" and len(t) < p.max_tokens for (t, _, r), p in zip(got.values(), params))
    # scheduling ran ahead: a step was prepared before the results of the one before it were taken
    assert "prepare,prepare" in ",".join(events)
    _released(core)


def test_no_step_is_scheduled_past_max_tokens(loaded_model, tokenizer):
    core = make_core(loaded_model, async_scheduling=True)
    counted: list[int] = []
    prepare = core.runner.prepare

    def prep(sched):
        counted.extend(e.num_new_tokens for e in sched.scheduled)
        return prepare(sched)

    core.runner.prepare = prep
    ids = _ids(tokenizer)[:1]
    got = _run(core, ids, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert len(got["0"][0]) == 5 and got["0"][2] == "length"
    assert counted == [len(ids[0]), 1, 1, 1, 1]  # the prompt, then one step per token after the first


def test_abort_while_a_step_is_in_flight(loaded_model, tokenizer):
    ids = _ids(tokenizer)[:4]
    params = SamplingParams(temperature=0.8, seed=21, max_tokens=16, ignore_eos=True)
    alone = _run(make_core(loaded_model), [ids[0], ids[2]], params)
    core = make_core(loaded_model, async_scheduling=True)
    got = _run(core, ids, params, abort_at={3: ["1"], 6: ["3"]})
    assert got["0"] == alone["0"] and got["2"] == alone["1"]
    assert got["1"][2] is None and got["3"][2] is None and 0 < len(got["1"][0]) < len(got["3"][0]) < 16
    _released(core)


def test_preemption_is_exact(loaded_model, tokenizer):
    ids = _ids(tokenizer) * 2
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    free = _run(make_core(loaded_model, budget=256), ids, params)
    core = make_core(loaded_model, budget=256, num_blocks=8, async_scheduling=True)
    pressured = _run(core, ids, params)
    assert core.scheduler.num_preemptions > 0
    _assert_same(pressured, free)
    _released(core)


@pytest.mark.parametrize("kind", ["grammar", "guidance"])
def test_batches_needing_tokens_on_the_host_step_synchronously(loaded_model, tokenizer, kind):
    ids = _ids(tokenizer)[:3]
    if kind == "grammar":
        schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        special = SamplingParams(temperature=0.0, max_tokens=24,
                                 structured_outputs=StructuredOutputsParams(json=json.dumps(schema)))
    else:
        special = SamplingParams(temperature=0.0, max_tokens=8, guidance_scale=1.5,
                                 negative_prompt_token_ids=tokenizer("Say something dull:").input_ids)
    plain = SamplingParams(temperature=0.8, seed=2, max_tokens=8)
    params = [plain, special, plain]
    sync = _run(make_core(loaded_model), ids, params)
    core = make_core(loaded_model, async_scheduling=True)
    events = _record(core)
    got = _run(core, ids, params)
    _assert_same(got, sync)
    if kind == "grammar":
        assert "city" in json.loads(tokenizer.decode(got["1"][0]))
    # all three join in the first step, so the special request is there throughout: never a step ahead
    assert "prepare,prepare" not in ",".join(events)
    _released(core)
