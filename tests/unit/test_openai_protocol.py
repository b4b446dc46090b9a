"""The OpenAI layer's pieces without HTTP: request parsing and SamplingParams mapping, error shapes, stream merging,
the SSE response's status / disconnect handling, metrics, and the fake engine the e2e tests rely on."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from pydantic import ValidationError

from tests.unit.fake_engine import VOCAB_SIZE, FakeEngine
from tokenspout.engine.exceptions import EngineDeadError
from tokenspout.entrypoints.openai.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionStreamChoice,
    CompletionRequest,
    DeltaMessage,
    OpenAIServingError,
    to_sampling_params,
    validation_error_to_serving_error,
)
from tokenspout.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenspout.entrypoints.openai.serving_common import PromptState, merge_outputs, to_serving_error
from tokenspout.entrypoints.openai.sse import (
    ChunkEnvelope,
    ClientDisconnected,
    SSEResponse,
    run_until_disconnect,
    sse_frame,
)
from tokenspout.metrics import ServerMetrics
from tokenspout.outputs import CompletionOutput, Logprob, RequestOutput
from tokenspout.sampling_params import RequestOutputKind, SamplingParams

MSG = [{"role": "user", "content": "hi"}]


def chat_req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MSG, **kw})


def serving_error(fn) -> OpenAIServingError:
    """The 400 a request gets, whether the request model (at parse time) or the params mapping finds the fault."""
    with pytest.raises((OpenAIServingError, ValidationError)) as e:
        fn()
    return validation_error_to_serving_error(e.value) if isinstance(e.value, ValidationError) else e.value


# ---------------------------------------------------------------------------------------------- request → params


def test_chat_maps_every_knob():
    req = chat_req(
        n=2, temperature=0.3, top_p=0.9, max_tokens=12, stop="END", seed=7, presence_penalty=0.1,
        frequency_penalty=-0.2, logit_bias={"5": -100, "17": 2.5}, logprobs=True, top_logprobs=4, top_k=40,
        min_p=0.05, repetition_penalty=1.2, min_tokens=3, ignore_eos=True, stop_token_ids=[2, 3],
        include_stop_str_in_output=True, skip_special_tokens=False, spaces_between_special_tokens=False,
        allowed_token_ids=[1, 2, 3], bad_words=["bad"], stream=True, user="u",
    )
    sp = to_sampling_params(req)
    assert (sp.n, sp.temperature, sp.top_p, sp.max_tokens, sp.stop, sp.seed) == (2, 0.3, 0.9, 12, ["END"], 7)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.1, -0.2, 1.2)
    assert sp.logit_bias == {5: -100.0, 17: 2.5} and sp.logprobs == 4
    assert (sp.top_k, sp.min_p, sp.min_tokens, sp.ignore_eos) == (40, 0.05, 3, True)
    assert sp.stop_token_ids == [2, 3] and sp.include_stop_str_in_output
    assert not sp.skip_special_tokens and not sp.spaces_between_special_tokens
    assert sp.allowed_token_ids == [1, 2, 3] and sp.bad_words == ["bad"]
    assert sp.output_kind == RequestOutputKind.DELTA


def test_neutral_defaults_and_output_kinds():
    sp = chat_req().to_sampling_params()
    assert sp.max_tokens is None  # chat: until the context ends
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)
    assert sp.logprobs is None and sp.logit_bias is None and sp.stop == []
    assert sp.output_kind == RequestOutputKind.FINAL_ONLY
    csp = CompletionRequest(prompt="x").to_sampling_params()
    assert csp.max_tokens == 16 and csp.output_kind == RequestOutputKind.FINAL_ONLY
    assert CompletionRequest(prompt="x", max_tokens=None, logprobs=0).to_sampling_params().max_tokens is None
    assert CompletionRequest(prompt="x", logprobs=0).to_sampling_params().logprobs == 0


def test_max_completion_tokens_wins_and_is_named_in_errors():
    assert chat_req(max_tokens=5, max_completion_tokens=9).to_sampling_params().max_tokens == 9
    err = serving_error(lambda: chat_req(max_completion_tokens=-2).to_sampling_params())
    assert err.param == "max_completion_tokens" and "max_completion_tokens" in err.message


def test_chat_logprobs_mapping():
    assert chat_req(logprobs=True).to_sampling_params().logprobs == 0
    assert chat_req(logprobs=False).to_sampling_params().logprobs is None
    assert serving_error(lambda: chat_req(top_logprobs=3).to_sampling_params()).param == "top_logprobs"
    with pytest.raises(ValidationError):
        chat_req(logprobs=True, top_logprobs=21)


@pytest.mark.parametrize(
    ("kw", "param"),
    [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"n": 0}, "n"), ({"max_tokens": 0},
     "max_tokens"), ({"min_p": 2}, "min_p"), ({"logit_bias": {"x1": 1}}, "logit_bias"), ({"stop": [""]}, "stop"),
     ({"min_tokens": 5, "max_tokens": 2}, "min_tokens")],
)
def test_sampling_errors_name_the_field(kw, param):
    err = serving_error(lambda: chat_req(**kw).to_sampling_params())
    assert err.status == 400 and err.param == param
    body = err.to_response().model_dump()
    assert body == {"error": {"message": err.message, "type": "BadRequestError", "param": param, "code": 400}}


def test_completion_extras_rejected():
    assert serving_error(lambda: CompletionRequest(prompt="x", suffix="y").to_sampling_params()).param == "suffix"
    assert serving_error(lambda: CompletionRequest(prompt="x", best_of=3).to_sampling_params()).param == "best_of"


def test_validation_errors_name_the_path():
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": 5}]})
    err = validation_error_to_serving_error(e.value)
    assert err.status == 400 and err.param == "messages.0.content"
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": ["a", [1]]})
    err = validation_error_to_serving_error(e.value)
    assert err.param == "prompt" and err.message.startswith("prompt must be a string")


def test_template_messages():
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]})
    assert req.template_messages() == [
        {"role": "system", "content": "rules"}, {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "tool_calls": []},
    ]
    assert serving_error(ChatCompletionRequest(messages=[]).template_messages).param == "messages"
    bad_role = ChatCompletionRequest.model_validate({"messages": [{"role": "robot", "content": "x"}]})
    assert serving_error(bad_role.template_messages).param == "messages.0.role"
    image = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert serving_error(image.template_messages).param == "messages.0.content.0"


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]), ([[1], [2, 3]], [[1], [2, 3]])],
)
def test_prompt_forms(prompt, expected):
    assert CompletionRequest(prompt=prompt).prompts() == expected


@pytest.mark.parametrize("prompt", [[], [[]], [[1], []]])
def test_empty_prompts_rejected(prompt):
    assert serving_error(CompletionRequest(prompt=prompt).prompts).param == "prompt"


def test_delta_serializes_only_set_keys():
    assert json.loads(DeltaMessage(content="x").model_dump_json()) == {"content": "x"}
    assert json.loads(DeltaMessage(role="assistant", content="").model_dump_json()) == {"role": "assistant",
                                                                                         "content": ""}
    assert json.loads(DeltaMessage().model_dump_json()) == {}


def test_chunk_envelope_matches_full_serialization():
    kw = {"id": "chatcmpl-1", "created": 5, "model": "m\"odel"}
    choices = [ChatCompletionStreamChoice(index=i, delta=DeltaMessage(content=f"t{i} \u00e9")) for i in range(2)]
    env = ChunkEnvelope(ChatCompletionChunk(**kw, choices=[]))
    assert env.frame(*choices) == sse_frame(ChatCompletionChunk(**kw, choices=choices))
    assert env.frame(choices[0]) == sse_frame(ChatCompletionChunk(**kw, choices=choices[:1]))


def test_engine_errors_map_to_http():
    assert to_serving_error(ValueError("prompt is too long")).param == "prompt"
    assert to_serving_error(ValueError("logit_bias has token id 9")).status == 400
    dead = to_serving_error(EngineDeadError("gone"))
    assert dead.status == 500 and dead.to_response().error.type == "InternalServerError"


# ---------------------------------------------------------------------------------------------- streams


async def _gen(name: str, items: list, log: list, delay: float = 0.0, fail: Exception | None = None):
    try:
        for x in items:
            await asyncio.sleep(delay)
            yield RequestOutput(name, None, [1], [CompletionOutput(0, x, [1])])
        if fail is not None:
            await asyncio.sleep(delay)
            raise fail
    finally:
        log.append(name)


async def test_merge_waits_for_every_first_output_and_fails_whole_request():
    log: list[str] = []
    merged = merge_outputs([_gen("a", ["1", "2"], log), _gen("b", [], log, delay=0.05, fail=ValueError("bad"))])
    with pytest.raises(ValueError, match="bad"):
        async for _ in merged:
            pytest.fail("nothing may be yielded before every prompt produced its first output")
    assert sorted(log) == ["a", "b"]


async def test_merge_interleaves_and_closing_closes_all():
    log: list[str] = []
    merged = merge_outputs([_gen("a", list("xyz"), log, 0.01), _gen("b", list("uvw"), log, 0.01)])
    got = []
    async for i, out in merged:
        got.append((i, out.outputs[0].text))
        if len(got) == 3:
            break
    await merged.aclose()
    assert sorted(log) == ["a", "b"] and {i for i, _ in got} <= {0, 1}


class _Asgi:
    """Minimal ASGI peer: records what is sent; `receive` reports a disconnect after `disconnect_after` s."""

    def __init__(self, disconnect_after: float | None = None) -> None:
        self.sent: list[dict] = []
        self.disconnect_after = disconnect_after

    async def receive(self) -> dict:
        if self.disconnect_after is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.disconnect_after)
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int:
        return self.sent[0]["status"]

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent[1:])


async def test_sse_error_before_first_frame_is_json_with_status():
    async def frames():
        raise OpenAIServingError("nope", param="prompt")
        yield b""  # pragma: no cover

    peer = _Asgi()
    await SSEResponse(frames())({"type": "http"}, peer.receive, peer.send)
    assert peer.status == 400 and json.loads(peer.body)["error"]["param"] == "prompt"


async def test_sse_streams_frames_and_closes_on_disconnect():
    closed = asyncio.Event()

    async def frames():
        try:
            yield b"data: 1\n\n"
            await asyncio.sleep(60)  # waiting on the engine when the client goes away
            yield b"data: 2\n\n"
        finally:
            closed.set()

    peer = _Asgi(disconnect_after=0.05)
    response = SSEResponse(frames())
    await asyncio.wait_for(response({"type": "http"}, peer.receive, peer.send), 5)
    assert closed.is_set() and response.client_disconnected
    assert peer.status == 200 and peer.body == b"data: 1\n\n"


async def test_run_until_disconnect():
    assert await run_until_disconnect(_Asgi().receive, asyncio.sleep(0, result=5)) == 5
    with pytest.raises(KeyError):  # errors come out as themselves, not wrapped in an ExceptionGroup
        await run_until_disconnect(_Asgi().receive, _raise(KeyError("k")))
    cancelled = asyncio.Event()

    async def slow():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(ClientDisconnected):
        await run_until_disconnect(_Asgi(disconnect_after=0.01).receive, slow())
    assert cancelled.is_set()


async def _raise(exc: Exception):
    raise exc


# ---------------------------------------------------------------------------------------------- accounting, logprobs


def test_prompt_state_counts_deltas_and_finals():
    m = ServerMetrics("m")
    st = PromptState(2, RequestOutputKind.DELTA, m, keep_text=True)
    st.observe(RequestOutput("r", "p", [1, 2, 3], [CompletionOutput(0, "a", [5]), CompletionOutput(1, "b", [6])]))
    st.observe(RequestOutput("r", "p", [1, 2, 3], [CompletionOutput(1, "c", [7, 8], finish_reason="stop")]))
    st.observe(RequestOutput("r", "p", [1, 2, 3], [CompletionOutput(0, "d", [9], finish_reason="length")],
                             finished=True))
    assert (st.prompt_tokens, st.completion_tokens) == (3, 5)
    assert [c.text for c in st.choices] == ["ad", "bc"]
    st.finish("abort")  # already finished: counted once
    text = m.render().decode()
    assert 'tokenspout:request_success_total{finished_reason="stop",model_name="m"} 1.0' in text
    assert 'tokenspout:generation_tokens_total{model_name="m"} 5.0' in text
    final = PromptState(1, RequestOutputKind.FINAL_ONLY, None, keep_text=True)
    final.observe(RequestOutput("r", "p", [1], [CompletionOutput(0, "xyz", [1, 2, 3], finish_reason="stop")], True))
    assert final.completion_tokens == 3 and final.choices[0].text == "xyz"


def test_chat_logprobs_top_n_by_rank_and_finite():
    serving = OpenAIServingChat(FakeEngine())
    pos = {11: Logprob(-3.0, 4, " x"), 12: Logprob(-0.1, 1, " a"), 13: Logprob(-0.5, 2, " b"),
           14: Logprob(-math.inf, 3, " c")}
    (entry,) = serving._logprobs([pos], top_n=3).content
    assert entry.token == " x" and entry.logprob == -3.0 and entry.bytes == [32, 120]
    assert [t.token for t in entry.top_logprobs] == [" a", " b", " c"]
    assert entry.top_logprobs[2].logprob == -9999.0


# ---------------------------------------------------------------------------------------------- metrics


def test_metrics_registries_are_independent_and_snapshots_only_add():
    a, b = ServerMetrics("a"), ServerMetrics("b")
    a.update_from_snapshot({"num_running": 3, "num_waiting": 1, "kv_cache_usage": 0.5, "num_preemptions": 4})
    a.update_from_snapshot({"num_preemptions": 6, "num_wasted_tokens": 10, "spec_num_accepted_tokens": 7})
    a.update_from_snapshot({"num_preemptions": 2})  # an engine restart resets totals: the counter never decreases
    a.add_wasted_tokens(5)
    a.observe_spec_decode(1, 4, 3)
    text = a.render().decode()
    assert 'tokenspout:num_requests_running{model_name="a"} 3.0' in text
    assert 'tokenspout:kv_cache_usage_perc{model_name="a"} 0.5' in text
    assert 'tokenspout:num_preemptions_total{model_name="a"} 6.0' in text
    assert 'tokenspout:wasted_tokens_total{model_name="a"} 15.0' in text
    assert 'tokenspout:spec_decode_num_accepted_tokens_total{model_name="a"} 10.0' in text
    assert 'model_name="a"' not in b.render().decode()


def test_prefix_cache_counters_follow_engine_totals():
    m = ServerMetrics("m")
    m.update_from_snapshot({"prefix_cache_queries": 100, "prefix_cache_hits": 64})
    m.update_from_snapshot({"prefix_cache_queries": 180, "prefix_cache_hits": 96})
    text = m.render().decode()
    assert 'tokenspout:prefix_cache_queries_total{model_name="m"} 180.0' in text
    assert 'tokenspout:prefix_cache_hits_total{model_name="m"} 96.0' in text


# ---------------------------------------------------------------------------------------------- app factory


def test_build_app_with_a_factory_owns_the_engine():
    from starlette.testclient import TestClient

    from tokenspout.entrypoints.openai.api_server import build_app

    made: list[FakeEngine] = []

    def factory() -> FakeEngine:  # called in the server's event loop at startup
        made.append(FakeEngine(model_name="built"))
        return made[-1]

    with TestClient(build_app(factory)) as c:
        assert made and c.get("/v1/models").json()["data"][0]["id"] == "built"
        assert c.get("/health").status_code == 200
        made[0].kill()
        assert c.get("/health").status_code == 503
    assert made[0].was_shut_down


# ---------------------------------------------------------------------------------------------- the fake engine


async def _collect(engine: FakeEngine, prompt, sp: SamplingParams) -> list[RequestOutput]:
    return [o async for o in engine.generate(prompt, sp, "r")]


@pytest.mark.parametrize("stop", [[], [" the", "e"], ["!"]])
async def test_fake_engine_delta_concatenates_to_final(stop):
    eng = FakeEngine()
    kw = {"n": 3, "temperature": 0.9, "seed": 5, "max_tokens": 40, "stop": stop, "logprobs": 2}
    final = await _collect(eng, "prompt", SamplingParams(**kw, output_kind=RequestOutputKind.FINAL_ONLY))
    deltas = await _collect(eng, "prompt", SamplingParams(**kw, output_kind=RequestOutputKind.DELTA))
    assert len(final) == 1 and final[0].finished
    for c in final[0].outputs:
        parts = [d for o in deltas for d in o.outputs if d.index == c.index]
        assert "".join(d.text for d in parts) == c.text
        assert [t for d in parts for t in d.token_ids] == c.token_ids
        assert sum(len(d.logprobs) for d in parts) == len(c.token_ids)
        assert parts[-1].finish_reason == c.finish_reason
        for s in stop:
            assert s not in c.text


async def test_fake_engine_rejects_bad_input_at_first_step():
    eng = FakeEngine(max_model_len=32)
    for prompt, sp in [("x" * 40, SamplingParams()), ([VOCAB_SIZE], SamplingParams()),
                       ("ok", SamplingParams(logit_bias={VOCAB_SIZE + 1: 1.0}))]:
        gen = eng.generate(prompt, sp, "r")
        with pytest.raises(ValueError):
            await anext(gen)
    eng.kill()
    with pytest.raises(EngineDeadError):
        await anext(eng.generate("ok", SamplingParams(), "r"))


def test_large_tokenize_responses_serialize_in_chunks_to_the_same_json():
    from tokenspout.entrypoints.openai.serving_tokenization import TokenizeResponse, _json

    big = TokenizeResponse(count=200_001, max_model_len=8, tokens=list(range(200_001)))
    assert _json(big).body == big.model_dump_json().encode()
    small = TokenizeResponse(count=2, max_model_len=8, tokens=[1, 2], token_strs=["a", "b"])
    assert _json(small).body == small.model_dump_json().encode()
