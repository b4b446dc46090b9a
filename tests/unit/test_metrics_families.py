"""The Prometheus families a vLLM dashboard expects: names under a configurable prefix, types, label names and
buckets as vLLM's v1 metrics (vllm/v1/metrics/loggers.py) declare them; the engine-core timestamps that feed the
queue / prefill / decode / inference histograms, from the scheduler over the wire to the serving layer; TTFT of
non-streamed requests; the --metrics-prefix flag.  The end-to-end check against a real server is
tests/e2e/test_metrics_e2e.py."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenspout.config import SchedulerConfig
from tokenspout.core.kv_cache_manager import KVCacheManager
from tokenspout.core.request import Request
from tokenspout.core.scheduler import Scheduler
from tokenspout.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, RequestTimestamps
from tokenspout.engine.output_processor import OutputProcessor
from tokenspout.entrypoints import cli
from tokenspout.entrypoints.openai.serving_common import PromptState
from tokenspout.metrics import ServerMetrics, build_1_2_5_buckets
from tokenspout.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenspout.sampling_params import RequestOutputKind, SamplingParams
from tokenspout.step_io import ModelRunnerOutput

DASHBOARD_SERIES = Path(__file__).parents[1] / "data" / "vllm_grafana_series.txt"

# vLLM's declarations (vllm/v1/metrics/loggers.py), the oracle for types and buckets.
VLLM_REQUEST_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0]
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
             80.0, 160.0, 640.0, 2560.0]
VLLM_TPOT = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
VLLM_ITERATION_TOKENS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def dashboard_series() -> list[str]:
    lines = DASHBOARD_SERIES.read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def families(metrics: ServerMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def sample_names(metrics: ServerMetrics) -> set[str]:
    return {s.name for f in families(metrics).values() for s in f.samples}


def buckets(family) -> list[float]:
    return [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]


def test_every_dashboard_series_is_exported_under_the_vllm_prefix():
    names = sample_names(ServerMetrics("m", prefix="vllm", max_model_len=2048))
    series = dashboard_series()
    assert len(series) >= 20  # the data file was read
    assert [s for s in series if s not in names] == []
    assert not any(n.startswith("tokenspout:") for n in names)


def test_default_prefix_and_independent_instances():
    default, vllm = ServerMetrics("m"), ServerMetrics("m", prefix="vllm")  # no global registry: both coexist
    a, b = sample_names(default), sample_names(vllm)
    assert all(n.startswith("tokenspout:") for n in a)
    assert {n.replace("tokenspout:", "vllm:", 1) for n in a} == b
    default.observe_first_token(0.5)
    assert families(vllm)["vllm:time_to_first_token_seconds"].samples[-1].value == 0  # _created aside: untouched


@pytest.mark.parametrize("prefix", ["", "vllm:", "1abc", "a-b", "a b"])
def test_bad_prefix_is_a_value_error_naming_the_field(prefix):
    with pytest.raises(ValueError, match="^metrics_prefix"):
        ServerMetrics("m", prefix=prefix)


def test_types_labels_and_buckets_follow_vllm():
    fams = families(ServerMetrics("m", prefix="vllm", max_model_len=2048))
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]  # vLLM's docstring example
    tokens = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    expected = {
        "vllm:iteration_tokens_total": VLLM_ITERATION_TOKENS,
        "vllm:request_prompt_tokens": tokens,
        "vllm:request_generation_tokens": tokens,
        "vllm:request_params_max_tokens": tokens,
        "vllm:request_max_num_generation_tokens": tokens,
        "vllm:request_params_n": [1, 2, 5, 10, 20],
        "vllm:request_queue_time_seconds": VLLM_REQUEST_LATENCY,
        "vllm:request_inference_time_seconds": VLLM_REQUEST_LATENCY,
        "vllm:request_prefill_time_seconds": VLLM_REQUEST_LATENCY,
        "vllm:request_decode_time_seconds": VLLM_REQUEST_LATENCY,
        "vllm:time_to_first_token_seconds": VLLM_TTFT,
        "vllm:time_per_output_token_seconds": VLLM_TPOT,
        "vllm:request_time_per_output_token_seconds": VLLM_TPOT,
    }
    for name, want in expected.items():
        assert fams[name].type == "histogram", name
        assert buckets(fams[name]) == [float(b) for b in want], name
    # Kept finer than vLLM's, but never coarser: every vLLM bucket is there.
    for name, want in (("vllm:inter_token_latency_seconds", VLLM_TPOT),
                       ("vllm:e2e_request_latency_seconds", VLLM_REQUEST_LATENCY)):
        assert set(map(float, want)) <= set(buckets(fams[name])), name
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "gpu_cache_usage_perc"):
        assert fams["vllm:" + name].type == "gauge"
    for name in ("request_success", "prompt_tokens", "generation_tokens", "num_preemptions", "prefix_cache_queries",
                 "prefix_cache_hits"):
        assert fams["vllm:" + name].type == "counter"  # exported as vllm:<name>_total
    success = [s for s in fams["vllm:request_success"].samples if s.name == "vllm:request_success_total"]
    assert {tuple(sorted(s.labels)) for s in success} == {("finished_reason", "model_name")}
    assert all(s.labels["model_name"] == "m" for f in fams.values() for s in f.samples)


def test_cache_config_info_is_a_gauge_at_one_with_the_config_as_labels():
    m = ServerMetrics("m", prefix="vllm")
    info = {"block_size": "16", "cache_dtype": "auto", "enable_prefix_caching": "True", "num_gpu_blocks": "512",
            "num_cpu_blocks": "0"}
    m.set_cache_config_info(info)
    m.set_cache_config_info(info)  # idempotent
    fam = families(m)["vllm:cache_config_info"]
    assert fam.type == "gauge"
    assert [(s.labels, s.value) for s in fam.samples] == [(info, 1.0)]


def test_iteration_tokens_and_gpu_cache_alias():
    m = ServerMetrics("m", prefix="vllm")
    for n in (0, 7, 300):  # a batch without tokens (stats only) is not a step
        m.observe_iteration_tokens(n)
    m.update_from_snapshot({"kv_cache_usage": 0.25})
    values = {s.name: s.value for f in families(m).values() for s in f.samples}
    assert values["vllm:iteration_tokens_total_count"] == 2 and values["vllm:iteration_tokens_total_sum"] == 307
    assert values["vllm:kv_cache_usage_perc"] == values["vllm:gpu_cache_usage_perc"] == 0.25


# ------------------------------------------------------------------------------- engine timestamps, end to end


def test_request_timestamps_travel_per_batch_not_per_output():
    enc = msgspec.msgpack.encode
    # An output carries no timestamps (msgspec writes every field of an array-like struct, so a timestamp there
    # would cost bytes on every token; the last nil is the prompt_logprobs slot); a batch without first outputs adds
    # one nil.
    assert enc(EngineCoreOutput("r", [1, 2])) == enc(["r", [1, 2], None, None, None, 0, None])
    assert enc(EngineCoreOutputs([], timestamp=1.0)) == enc([[], None, 1.0, None, None])
    batch = EngineCoreOutputs([EngineCoreOutput("r", [1])], timestamp=11.0,
                              request_timestamps=[RequestTimestamps("r", 10.0, 10.5)])
    back = msgspec.msgpack.decode(enc(batch), type=EngineCoreOutputs)
    assert back.request_timestamps == [RequestTimestamps("r", 10.0, 10.5)]


def test_scheduler_stamps_queue_and_first_schedule_once_per_request():
    kv = KVCacheManager(64, 16)
    sched = Scheduler(SchedulerConfig(), kv, max_model_len=256)
    before = time.monotonic()
    req = Request(EngineCoreRequest("r", list(range(40)), SamplingParams(max_tokens=3)), seed=0, max_model_len=256)
    sched.add_request(req)
    outs, stamps = [], []
    for tok in (5, 6, 7):
        step = sched.schedule()
        outs += sched.update_from_output(step, ModelRunnerOutput(sampled={"r": [tok]}))
        stamps.append(sched.take_request_timestamps())
    after = time.monotonic()
    assert [o.new_token_ids for o in outs] == [[5], [6], [7]] and outs[-1].finish_reason == "length"
    (first,), later = stamps[0], stamps[1:]
    assert first.request_id == "r" and before <= first.queued_ts <= first.scheduled_ts <= after
    assert later == [None, None]  # the first output only


def _request(rid="r", kind=RequestOutputKind.FINAL_ONLY, n_prompt=4, **params):
    sp = SamplingParams(output_kind=kind, detokenize=False, **params)
    return EngineCoreRequest(rid, list(range(1, n_prompt + 1)), sp, arrival_time=time.time() - 0.25)


def test_output_processor_turns_engine_timestamps_into_request_metrics():
    op = OutputProcessor(None)
    op.add_request(_request(max_tokens=3), None)
    res = op.process_outputs([EngineCoreOutput("r", [5])], 101.0, {"r": RequestTimestamps("r", 100.0, 100.5)})
    assert res.request_outputs == [] and res.num_tokens == 4 + 1  # FINAL_ONLY: nothing yet; prompt + token
    assert op.process_outputs([EngineCoreOutput("r", [6])], 101.25).num_tokens == 1
    res = op.process_outputs([EngineCoreOutput("r", [7], finish_reason="length")], 101.75)
    (out,) = res.request_outputs
    m = out.outputs[0].metrics
    assert m is not None and m.max_tokens_param == 3
    assert m.queued_time == pytest.approx(0.5)  # 100.0 -> 100.5
    assert m.prefill_time == pytest.approx(0.5)  # 100.5 -> 101.0 (the first token's step)
    assert m.decode_time == pytest.approx(0.75)  # 101.0 -> 101.75
    assert m.inference_time == pytest.approx(1.25)
    assert 0.25 <= m.first_token_latency < 5  # frontend clock: arrival 0.25 s ago -> first token processed


def test_no_engine_clock_no_phases():
    op = OutputProcessor(None)
    op.add_request(_request(max_tokens=1), None)
    (out,) = op.process_outputs([EngineCoreOutput("r", [5], finish_reason="length")], None,
                                {"r": RequestTimestamps("r", 1.0, 2.0)}).request_outputs
    m = out.outputs[0].metrics
    assert m.first_token_latency is not None and m.prefill_time is None and m.inference_time is None


# ------------------------------------------------------------------------------- serving layer


def _final(metrics: RequestMetrics | None, n_tokens=3, reason="length", index=0) -> CompletionOutput:
    return CompletionOutput(index, "", list(range(n_tokens)), finish_reason=reason, metrics=metrics)


def values(m: ServerMetrics) -> dict[str, float]:
    return {s.name: s.value for f in families(m).values() for s in f.samples}


def test_non_streamed_request_gets_ttft_and_phase_histograms():
    m = ServerMetrics("m", prefix="vllm")
    st = PromptState(2, RequestOutputKind.FINAL_ONLY, m, keep_text=False)
    rm = [RequestMetrics(first_token_latency=0.3, queued_time=0.1, prefill_time=0.2, decode_time=0.4,
                         inference_time=0.6, max_tokens_param=8),
          RequestMetrics(first_token_latency=0.2, queued_time=0.05, prefill_time=0.1, decode_time=0.1,
                         inference_time=0.2, max_tokens_param=8)]
    st.observe(RequestOutput("x", None, [1, 2, 3, 4, 5], [_final(rm[0], 3, index=0), _final(rm[1], 5, index=1)],
                             finished=True))
    st.finish("abort")
    st.finish("abort")  # once
    v = values(m)
    assert v["vllm:time_to_first_token_seconds_count"] == 1
    assert v["vllm:time_to_first_token_seconds_sum"] == pytest.approx(0.2)  # the prompt's first token
    assert v["vllm:request_queue_time_seconds_count"] == 2
    assert v["vllm:request_queue_time_seconds_sum"] == pytest.approx(0.15)
    assert v["vllm:request_prefill_time_seconds_sum"] == pytest.approx(0.3)
    assert v["vllm:request_decode_time_seconds_sum"] == pytest.approx(0.5)
    assert v["vllm:request_inference_time_seconds_sum"] == pytest.approx(0.8)
    assert v["vllm:request_prompt_tokens_count"] == 2 and v["vllm:request_prompt_tokens_sum"] == 10  # per choice
    assert v["vllm:request_generation_tokens_sum"] == 8
    assert v["vllm:request_params_n_count"] == 1 and v["vllm:request_params_n_sum"] == 2  # per prompt
    assert v["vllm:request_max_num_generation_tokens_sum"] == 5
    assert v["vllm:request_params_max_tokens_count"] == 2 and v["vllm:request_params_max_tokens_sum"] == 16
    # decode / (tokens - 1) per choice: 0.4 / 2 and 0.1 / 4
    assert v["vllm:request_time_per_output_token_seconds_sum"] == pytest.approx(0.2 + 0.025)
    assert v["vllm:prompt_tokens_total"] == 5 and v["vllm:generation_tokens_total"] == 8
    success = {s.labels["finished_reason"]: s.value for s in families(m)["vllm:request_success"].samples
               if s.name.endswith("_total")}
    assert success["length"] == 2


def test_streamed_ttft_is_timed_once_by_the_serving_layer():
    m = ServerMetrics("m", prefix="vllm")
    st = PromptState(1, RequestOutputKind.DELTA, m, keep_text=False)
    st.observe(RequestOutput("x", None, [1, 2], [CompletionOutput(0, "a", [7])]))
    st.observe(RequestOutput("x", None, [1, 2], [_final(RequestMetrics(first_token_latency=9.0), 1, "stop")],
                             finished=True))
    v = values(m)
    assert v["vllm:time_to_first_token_seconds_count"] == 1
    assert v["vllm:time_to_first_token_seconds_sum"] < 9.0  # the stream's own timing, not the engine's
    assert v["vllm:inter_token_latency_seconds_count"] == v["vllm:time_per_output_token_seconds_count"] == 1


def test_aborted_choices_count_tokens_but_not_phases():
    m = ServerMetrics("m", prefix="vllm")
    st = PromptState(1, RequestOutputKind.FINAL_ONLY, m, keep_text=False)
    rm = RequestMetrics(first_token_latency=0.1, queued_time=0.1, prefill_time=0.1, decode_time=0.1,
                        inference_time=0.2)
    st.observe(RequestOutput("x", None, [1], [_final(rm, 2, "abort")], finished=True))
    v = values(m)
    assert v["vllm:request_generation_tokens_count"] == 1
    assert v["vllm:request_queue_time_seconds_count"] == v["vllm:request_inference_time_seconds_count"] == 0


# ------------------------------------------------------------------------------- CLI


def test_cli_metrics_prefix_flag(monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, "cmd_serve", lambda args: seen.setdefault("prefix", args.metrics_prefix) and 0)
    cli.main(["serve"])
    assert seen.pop("prefix") == "tokenspout"
    cli.main(["serve", "--metrics-prefix", "vllm"])
    assert seen.pop("prefix") == "vllm"
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--metrics-prefix", "vllm:"])
    assert e.value.code == 2
