"""A real server (AsyncLLM on the default model) built with metrics_prefix="vllm": every series vLLM's Grafana
dashboards query (tests/data/vllm_grafana_series.txt) is exported, and the new per-request histograms counted a
streamed and a non-streamed request with values that agree with each other and with the usage the client got."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import background_server, real_engine
from tests.unit.test_metrics_families import dashboard_series

MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def engine():
    with real_engine() as real:
        yield real


@pytest.fixture(scope="module")
def server(engine):
    with background_server(engine, metrics_prefix="vllm") as srv:
        yield srv


def scrape(server) -> tuple[dict[str, float], list]:
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200
    fams = list(text_string_to_metric_families(r.text))
    return {s.name: s.value for f in fams for s in f.samples if "le" not in s.labels}, fams


def test_vllm_dashboard_reads_this_server(server, engine):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = engine.model_name
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=0)
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = chunks[-1].usage
    assert streamed is not None and plain.usage is not None

    v, fams = scrape(server)
    names = {s.name for f in fams for s in f.samples}
    assert [s for s in dashboard_series() if s not in names] == []
    assert not any(n.startswith("tokenspout:") for n in names)
    labelled = [s for f in fams if f.name != "vllm:cache_config_info" for s in f.samples]
    assert {s.labels["model_name"] for s in labelled} == {model}  # the dashboards' $model_name selector

    prompt = plain.usage.prompt_tokens + streamed.prompt_tokens
    completion = plain.usage.completion_tokens + streamed.completion_tokens
    assert v["vllm:request_prompt_tokens_count"] == 2 and v["vllm:request_prompt_tokens_sum"] == prompt
    assert v["vllm:request_generation_tokens_sum"] == completion
    assert v["vllm:prompt_tokens_total"] == prompt and v["vllm:generation_tokens_total"] == completion
    assert v["vllm:request_params_n_sum"] == 2 and v["vllm:request_max_num_generation_tokens_sum"] == completion
    assert v["vllm:request_params_max_tokens_sum"] == 12
    # Both requests timed to their first token, the non-streamed one included.
    assert v["vllm:time_to_first_token_seconds_count"] == 2
    for phase in ("queue", "prefill", "decode", "inference"):
        assert v[f"vllm:request_{phase}_time_seconds_count"] == 2, phase
    e2e = v["vllm:e2e_request_latency_seconds_sum"]
    assert 0 <= v["vllm:request_queue_time_seconds_sum"] <= e2e
    assert 0 < v["vllm:request_inference_time_seconds_sum"] <= e2e
    assert v["vllm:request_prefill_time_seconds_sum"] + v["vllm:request_decode_time_seconds_sum"] == pytest.approx(
        v["vllm:request_inference_time_seconds_sum"], rel=1e-6)
    assert v["vllm:request_prefill_time_seconds_sum"] <= v["vllm:time_to_first_token_seconds_sum"]
    # Every token the engine stepped over: the two prompts and every generated token, in steps of at most
    # max_num_batched_tokens.
    assert v["vllm:iteration_tokens_total_sum"] == prompt + completion
    assert v["vllm:iteration_tokens_total_count"] >= completion
    # The streamed request's gaps, under both names a dashboard may use.
    itl = v["vllm:inter_token_latency_seconds_count"]
    assert itl == v["vllm:time_per_output_token_seconds_count"] >= 1

    (info,) = [s for f in fams if f.name == "vllm:cache_config_info" for s in f.samples]
    assert info.value == 1
    assert info.labels["num_gpu_blocks"] == str(engine.num_kv_blocks)
    assert info.labels["block_size"] == str(engine.config.cache.block_size)
    assert info.labels["enable_prefix_caching"] == "True"
