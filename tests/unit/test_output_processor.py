"""OutputProcessor: every request ends exactly once, late outputs are dropped and counted, streamed (DELTA) text
equals the non-streamed text, n > 1 aggregation, aborts, engine errors, logprobs, async collectors."""

from __future__ import annotations

import asyncio
import math

import pytest

from tokenspout.engine.exceptions import EngineDeadError
from tokenspout.engine.messages import EngineCoreOutput, EngineCoreRequest, TokenLogprobs
from tokenspout.engine.output_processor import OutputProcessor
from tokenspout.engine.parallel_sampling import ParentRequest, RequestOutputCollector
from tokenspout.outputs import RequestOutput
from tokenspout.sampling_params import RequestOutputKind, SamplingParams

DELTA, CUMULATIVE, FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY


def _add(op, tokenizer, rid="r", kind=CUMULATIVE, prompt="Prompt:", queue=None, arrival_time=0.0, **params):
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    params.setdefault("eos_token_id", tokenizer.eos_token_id)  # as the Processor fills it in
    sp = SamplingParams(output_kind=kind, max_tokens=None, **params)
    op.add_request(EngineCoreRequest(rid, prompt_ids, sp, arrival_time), prompt, queue=queue)
    return prompt_ids


def _out(rid, ids, finish=None, **kw):
    return EngineCoreOutput(rid, list(ids), finish_reason=finish, **kw)


def _steps(op, rid, ids, per_step=1, finish="length", stop_reason=None):
    """Feeds `ids` in steps, the last one finishing; returns every RequestOutput produced."""
    outs: list[RequestOutput] = []
    for i in range(0, len(ids), per_step):
        last = i + per_step >= len(ids)
        res = op.process_outputs([_out(rid, ids[i:i + per_step], finish if last else None,
                                       stop_reason=stop_reason if last else None)])
        outs += res.request_outputs
    return outs


def test_finishes_exactly_once_and_drops_late_outputs(tokenizer):
    op = OutputProcessor(tokenizer)
    _add(op, tokenizer)
    ids = tokenizer.encode(" one two three", add_special_tokens=False)
    outs = _steps(op, "r", ids)
    assert [o.finished for o in outs] == [False] * (len(ids) - 1) + [True]
    assert outs[-1].outputs[0].finish_reason == "length"
    assert outs[-1].outputs[0].text == " one two three"
    assert not op.has_unfinished_requests()
    # The engine repeats itself / sends stragglers: dropped, counted as wasted, no second finish.
    res = op.process_outputs([_out("r", [5, 6], "length"), _out("unknown", [7])])
    assert res.request_outputs == [] and res.reqs_to_abort == []
    stats = op.take_stats()
    assert stats.finished_by_reason == {"length": 1}
    assert stats.num_wasted_tokens == 3
    assert stats.num_generation_tokens == len(ids)


def test_stop_string_finish_aborts_engine_and_counts_waste(tokenizer):
    op = OutputProcessor(tokenizer)
    _add(op, tokenizer, stop=[" two"])
    ids = tokenizer.encode(" one two three four", add_special_tokens=False)
    # All four tokens in one step (as with speculative decoding): two of them lie past the stop string.
    res = op.process_outputs([_out("r", ids)])
    assert res.reqs_to_abort == ["r"]
    (ro,) = res.request_outputs
    c = ro.outputs[0]
    assert ro.finished and (c.text, c.finish_reason, c.stop_reason) == (" one", "stop", " two")
    assert c.token_ids == ids[:2]
    # The engine had not seen the abort yet: its next outputs are dropped and counted.
    res = op.process_outputs([_out("r", [100]), _out("r", [101], "abort")])
    assert res.request_outputs == [] and res.reqs_to_abort == []
    stats = op.take_stats()
    assert stats.num_wasted_tokens == (len(ids) - 2) + 2
    assert stats.finished_by_reason == {"stop": 1}


def test_stop_string_and_engine_finish_in_same_step_needs_no_abort(tokenizer):
    op = OutputProcessor(tokenizer)
    _add(op, tokenizer, stop=["three"])
    ids = tokenizer.encode(" one two three", add_special_tokens=False)
    res = op.process_outputs([_out("r", ids, "length")])
    assert res.reqs_to_abort == []
    assert res.request_outputs[0].outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("per_step", [1, 3])
def test_delta_concatenation_equals_cumulative_and_final_only(tokenizer, per_step):
    text = " Streamed 👨\u200d👩\u200d👧 text with 中文 and e\u0301 and a stop marker END and more"
    ids = tokenizer.encode(text, add_special_tokens=False)
    lps = [TokenLogprobs(-0.5 - i / 10, 1, [t, 42], [-0.5 - i / 10, -3.0]) for i, t in enumerate(ids)]
    results = {}
    for kind in (DELTA, CUMULATIVE, FINAL_ONLY):
        op = OutputProcessor(tokenizer)
        _add(op, tokenizer, kind=kind, stop=[" END"], logprobs=1)
        outs = []
        for i in range(0, len(ids), per_step):
            res = op.process_outputs([EngineCoreOutput("r", ids[i:i + per_step], lps[i:i + per_step])])
            outs += res.request_outputs
            if not op.has_unfinished_requests():
                break
        assert outs[-1].finished and sum(o.finished for o in outs) == 1
        if kind == DELTA:
            chunks = [o.outputs[0] for o in outs]
            results[kind] = ("".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids],
                             [p for c in chunks for p in c.logprobs], chunks[-1].cumulative_logprob)
            assert all("\ufffd" not in c.text for c in chunks)
        else:
            c = outs[-1].outputs[0]
            results[kind] = (c.text, c.token_ids, c.logprobs, c.cumulative_logprob)
        if kind == FINAL_ONLY:
            assert len(outs) == 1
    assert results[DELTA] == results[CUMULATIVE] == results[FINAL_ONLY]
    text_out, token_ids, logprobs, cum = results[CUMULATIVE]
    assert text_out == text[:text.index(" END")]
    assert len(logprobs) == len(token_ids)
    assert math.isclose(cum, sum(lp.logprob for lp in lps[:len(token_ids)]))


def test_logprobs_conversion(tokenizer):
    op = OutputProcessor(tokenizer)
    _add(op, tokenizer, logprobs=2)
    hello, world = tokenizer.encode(" hello world", add_special_tokens=False)
    # Sampled token outside the top-2 (rank 7), then one that is the top-1.
    lps = [TokenLogprobs(-4.0, 7, [world, 2], [-0.1, -1.5]), TokenLogprobs(-0.2, 1, [world, hello], [-0.2, -2.0])]
    res = op.process_outputs([EngineCoreOutput("r", [hello, world], lps, finish_reason="length")])
    c = res.request_outputs[0].outputs[0]
    first, second = c.logprobs
    assert list(first) == [hello, world, 2]  # the sampled token first
    assert (first[hello].logprob, first[hello].rank, first[hello].decoded_token) == (-4.0, 7, " hello")
    assert (first[world].rank, first[world].decoded_token) == (1, " world")
    assert first[2].decoded_token == "<|im_end|>"
    assert list(second) == [world, hello] and second[world].rank == 1 and second[hello].rank == 2
    assert math.isclose(c.cumulative_logprob, -4.2)


def test_no_logprobs_means_none(tokenizer):
    op = OutputProcessor(tokenizer)
    _add(op, tokenizer)
    res = op.process_outputs([_out("r", [100], "length")])
    c = res.request_outputs[0].outputs[0]
    assert c.logprobs is None and c.cumulative_logprob is None


@pytest.mark.parametrize("skip", [True, False])
def test_eos_text_excluded_but_id_kept(tokenizer, skip):
    ids = tokenizer.encode(" bye", add_special_tokens=False) + [tokenizer.eos_token_id]
    op = OutputProcessor(tokenizer)
    _add(op, tokenizer, skip_special_tokens=skip)
    c = _steps(op, "r", ids, finish="stop")[-1].outputs[0]
    assert (c.text, c.token_ids, c.finish_reason) == (" bye", ids, "stop")
    # include_stop_str_in_output keeps the stop token's text (visible only when special tokens are kept).
    op = OutputProcessor(tokenizer)
    _add(op, tokenizer, skip_special_tokens=skip, include_stop_str_in_output=True)
    c = _steps(op, "r", ids, finish="stop", stop_reason=None)[-1].outputs[0]
    assert c.text == (" bye" if skip else " bye<|im_end|>")


def test_stop_token_id_reason_and_text(tokenizer):
    ids = tokenizer.encode(" a. b", add_special_tokens=False)
    dot = ids[1]
    op = OutputProcessor(tokenizer)
    _add(op, tokenizer, stop_token_ids=[dot])
    c = _steps(op, "r", ids[:2], finish="stop", stop_reason=dot)[-1].outputs[0]
    assert (c.text, c.stop_reason, c.token_ids) == (" a", dot, ids[:2])


def test_detokenize_false_and_cached_tokens(tokenizer):
    op = OutputProcessor(tokenizer)
    _add(op, tokenizer, detokenize=False)
    op.process_outputs([_out("r", [100, 101], num_cached_tokens=16)])
    res = op.process_outputs([_out("r", [102], "length")])
    ro = res.request_outputs[0]
    assert ro.outputs[0].text == "" and ro.outputs[0].token_ids == [100, 101, 102]
    assert ro.num_cached_tokens == 16


def test_duplicate_request_id_rejected(tokenizer):
    op = OutputProcessor(tokenizer)
    _add(op, tokenizer)
    with pytest.raises(ValueError, match="already running"):
        _add(op, tokenizer)
    _add(op, tokenizer, rid="p")
    with pytest.raises(ValueError, match="already running"):  # a parent's id collides with a running request
        _add_parent(op, tokenizer, n=2)


def _add_parent(op, tokenizer, n=3, kind=CUMULATIVE, queue=None, **params):
    params.setdefault("eos_token_id", tokenizer.eos_token_id)
    sp = SamplingParams(n=n, output_kind=kind, max_tokens=None, seed=5, **params)
    parent = ParentRequest("p", sp)
    prompt_ids = tokenizer.encode("Prompt:", add_special_tokens=False)
    for i, cid in enumerate(parent.child_request_ids):
        op.add_request(EngineCoreRequest(cid, prompt_ids, parent.child_params(i)), "Prompt:", parent, i, queue)
    return parent


def test_n_cumulative_and_final_only_aggregation(tokenizer):
    words = [tokenizer.encode(w, add_special_tokens=False) for w in (" zero", " one", " two")]
    for kind in (CUMULATIVE, FINAL_ONLY):
        op = OutputProcessor(tokenizer)
        parent = _add_parent(op, tokenizer, kind=kind)
        assert parent.child_request_ids == ["0_p", "1_p", "2_p"]
        # Children finish in the order 2, 0, 1, in separate steps.
        outs = []
        for i in (2, 0, 1):
            outs += op.process_outputs([_out(f"{i}_p", words[i], "length")]).request_outputs
        assert all(o.request_id == "p" for o in outs)
        if kind == FINAL_ONLY:
            assert len(outs) == 1
        else:
            assert [[c.index for c in o.outputs] for o in outs] == [[2], [0, 2], [0, 1, 2]]
        assert [o.finished for o in outs][-1] and not any(o.finished for o in outs[:-1])
        assert [c.text for c in outs[-1].outputs] == [" zero", " one", " two"]
        assert not op.has_unfinished_requests()
        assert op.take_stats().finished_by_reason == {"length": 3}


def test_n_delta_yields_changed_choices(tokenizer):
    op = OutputProcessor(tokenizer)
    _add_parent(op, tokenizer, n=2, kind=DELTA)
    a = tokenizer.encode(" alpha beta", add_special_tokens=False)
    b = tokenizer.encode(" gamma", add_special_tokens=False)
    r1 = op.process_outputs([_out("0_p", a[:1]), _out("1_p", b)]).request_outputs
    assert len(r1) == 1 and [(c.index, c.text) for c in r1[0].outputs] == [(0, " alpha"), (1, " gamma")]
    r2 = op.process_outputs([_out("0_p", a[1:])]).request_outputs
    assert [(c.index, c.text) for c in r2[0].outputs] == [(0, " beta")] and not r2[0].finished
    r3 = op.process_outputs([_out("1_p", [], "length")]).request_outputs
    assert [(c.index, c.text, c.finish_reason) for c in r3[0].outputs] == [(1, "", "length")]
    r4 = op.process_outputs([_out("0_p", [], "length")]).request_outputs
    assert r4[0].finished and [c.index for c in r4[0].outputs] == [0]


def test_abort_parent_aborts_all_children(tokenizer):
    op = OutputProcessor(tokenizer)
    _add_parent(op, tokenizer, n=3)
    op.process_outputs([_out("1_p", [100], "length")])  # one child already done
    op.process_outputs([_out("0_p", [101])])
    engine_ids = op.abort_requests(["p"])
    assert sorted(engine_ids) == ["0_p", "2_p"]
    assert not op.has_unfinished_requests()
    res = op.process_outputs([_out("0_p", [102]), _out("2_p", [103], "abort")])  # late: dropped
    (ro,) = res.request_outputs  # the abort's final output, handed out with the next batch
    assert ro.finished and [c.finish_reason for c in ro.outputs] == ["abort", "length", "abort"]
    assert op.take_stats().finished_by_reason == {"length": 1, "abort": 2}
    assert op.abort_requests(["p", "nope"]) == []  # aborting twice is a no-op


def test_abort_single_request_by_engine_id(tokenizer):
    op = OutputProcessor(tokenizer)
    _add(op, tokenizer, rid="a")
    _add(op, tokenizer, rid="b")
    assert op.abort_requests(["a"]) == ["a"]
    assert op.has_unfinished_requests()
    res = op.process_outputs([_out("b", [100], "length")])
    assert {(o.request_id, o.outputs[0].finish_reason) for o in res.request_outputs} == {("a", "abort"),
                                                                                          ("b", "length")}


async def test_collector_merges_deltas_and_replaces_cumulative(tokenizer):
    q = RequestOutputCollector(DELTA)
    op = OutputProcessor(tokenizer)
    _add(op, tokenizer, kind=DELTA, queue=q, logprobs=0)
    ids = tokenizer.encode(" one two three", add_special_tokens=False)
    lps = [TokenLogprobs(-1.0, 1, [], []) for _ in ids]
    for i, t in enumerate(ids):  # the consumer lags: three puts, one get
        res = op.process_outputs([EngineCoreOutput("r", [t], lps[i:i + 1])])
        assert res.request_outputs == []  # it went to the queue
    got = await q.get()
    assert got.outputs[0].text == " one two three" and got.outputs[0].token_ids == ids
    assert len(got.outputs[0].logprobs) == len(ids) and not got.finished
    assert q.get_nowait() is None
    op.process_outputs([_out("r", [], "length")])
    last = await asyncio.wait_for(q.get(), 1)
    assert last.finished and last.outputs[0].text == ""

    qc = RequestOutputCollector(CUMULATIVE)
    op = OutputProcessor(tokenizer)
    _add(op, tokenizer, kind=CUMULATIVE, queue=qc)
    for t in ids:
        op.process_outputs([_out("r", [t])])
    assert qc.get_nowait().outputs[0].text == " one two three"


async def test_collector_get_waits_for_put_on_same_loop():
    q = RequestOutputCollector(DELTA)
    waiter = asyncio.ensure_future(q.get())
    await asyncio.sleep(0)
    assert not waiter.done()
    q.put(RequestOutput("x", None, [1]))
    assert (await asyncio.wait_for(waiter, 1)).request_id == "x"


async def test_propagate_error_ends_everything(tokenizer):
    op = OutputProcessor(tokenizer)
    q = RequestOutputCollector(DELTA)
    _add(op, tokenizer, rid="queued", kind=DELTA, queue=q)
    _add(op, tokenizer, rid="plain")
    _add_parent(op, tokenizer, n=2)
    op.process_outputs([_out("queued", [100]), _out("plain", [101])])
    await q.get()
    op.propagate_error("engine core died")
    assert not op.has_unfinished_requests()
    with pytest.raises(EngineDeadError, match="engine core died"):
        await asyncio.wait_for(q.get(), 1)
    res = op.process_outputs([_out("plain", [102])])  # the engine is gone; a stray output is dropped
    by_id = {o.request_id: o for o in res.request_outputs}
    assert set(by_id) == {"plain", "p"}
    assert by_id["plain"].finished and by_id["plain"].outputs[0].finish_reason == "error"
    assert [c.finish_reason for c in by_id["p"].outputs] == ["error", "error"] and by_id["p"].finished
    assert op.take_stats().finished_by_reason == {"error": 4}


def test_latency_stats(tokenizer):
    import time

    op = OutputProcessor(tokenizer)
    _add(op, tokenizer, arrival_time=time.time() - 1.0)
    op.process_outputs([_out("r", [100])], engine_timestamp=10.0)
    op.process_outputs([_out("r", [101])], engine_timestamp=10.25)
    op.process_outputs([_out("r", [102], "length")], engine_timestamp=10.5)
    s = op.take_stats()
    assert len(s.ttft_s) == 1 and 1.0 <= s.ttft_s[0] < 30
    assert s.inter_token_s == [0.25, 0.25]
    assert len(s.e2e_s) == 1 and s.e2e_s[0] >= s.ttft_s[0]
    assert s.num_prompt_tokens == len(tokenizer.encode("Prompt:", add_special_tokens=False))
    again = op.take_stats()  # samples are handed out once; counters stay
    assert again.ttft_s == [] and again.inter_token_s == [] and again.num_generation_tokens == 3
