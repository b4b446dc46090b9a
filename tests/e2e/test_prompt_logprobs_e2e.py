"""Prompt logprobs and echo scoring over HTTP with the official openai client, on the real engine (float32 default
model, no quantization), checked against transformers' log_softmax where values are involved."""

from __future__ import annotations

import openai
import pytest
import torch

from tokenspout.entrypoints.openai.api_server import BackgroundServer, build_app

PROMPT = "The capital of France is Paris, and the capital of Italy is"
TOL = 1e-3


@pytest.fixture(scope="module")
def engine():
    from tokenspout.engine.async_llm import AsyncLLM
    from tokenspout.engine.llm import build_engine_config

    real = AsyncLLM(build_engine_config(None, max_model_len=1024, kv_cache_memory=0.25, max_num_batched_tokens=8))
    yield real  # a budget of 8 tokens: every prompt here is prefilled in several chunks
    real.shutdown()


@pytest.fixture(scope="module")
def client(engine):
    srv = BackgroundServer(build_app(engine)).start()
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    srv.stop()


@pytest.fixture(scope="module")
def model(engine) -> str:
    return engine.model_name


@pytest.fixture(scope="module")
def ref(hf_model, tokenizer):
    ids = tokenizer(PROMPT).input_ids
    with torch.no_grad():
        return ids, torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check_prompt_logprobs(plp: list, ids: list[int], lsm: torch.Tensor, k: int) -> None:
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        entry = plp[i]
        assert str(ids[i]) in entry and 1 <= len(entry) <= k + 1
        got = entry[str(ids[i])]
        assert abs(got["logprob"] - float(lsm[i - 1, ids[i]])) < TOL
        assert isinstance(got["decoded_token"], str) and got["rank"] >= 1
        best = int(lsm[i - 1].argmax())
        if k:
            assert str(best) in entry and entry[str(best)]["rank"] == 1


def test_completions_prompt_logprobs(client, model, ref):
    ids, lsm = ref
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    (choice,) = r.choices
    _check_prompt_logprobs(choice.model_extra["prompt_logprobs"], ids, lsm, 2)
    assert choice.logprobs is None and r.usage.completion_tokens == 2


def test_chat_prompt_logprobs_top_level(client, model, tokenizer, hf_model):
    messages = [{"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 1})
    plp = r.model_extra["prompt_logprobs"]
    ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False).input_ids
    with torch.no_grad():
        lsm = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    _check_prompt_logprobs(plp, ids, lsm, 1)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_logprobs_scores_the_prompt(client, model, ref, stream):
    ids, lsm = ref
    kw = dict(model=model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2)
    if stream:
        text, lp_tokens, token_lps, tops = "", [], [], []
        for chunk in client.completions.create(stream=True, **kw):
            for c in chunk.choices:
                text += c.text
                if c.logprobs is not None:
                    lp_tokens += c.logprobs.tokens
                    token_lps += c.logprobs.token_logprobs
                    tops += c.logprobs.top_logprobs
    else:
        (c,) = client.completions.create(**kw).choices
        text, lp_tokens, token_lps, tops = c.text, c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs
        assert len(c.model_extra["prompt_logprobs"]) == len(ids)  # echo + logprobs also fills prompt_logprobs
    assert text.startswith(PROMPT)
    assert len(token_lps) == len(ids) + 3 and "".join(lp_tokens) == text
    assert token_lps[0] is None and tops[0] is None  # the first prompt token, as OpenAI
    for i in range(1, len(ids)):
        assert abs(token_lps[i] - float(lsm[i - 1, ids[i]])) < TOL
        assert 1 <= len(tops[i]) <= 3
    assert all(x is not None for x in token_lps[len(ids):])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("logprobs", [None, 1])
def test_max_tokens_zero_echo_returns_the_scored_prompt(client, model, ref, stream, logprobs):
    ids, lsm = ref
    kw = dict(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=logprobs)
    if stream:
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        text = "".join(c.text for ch in chunks for c in ch.choices)
        finish = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
        lps = [x for ch in chunks for c in ch.choices if c.logprobs for x in c.logprobs.token_logprobs]
        usage = chunks[-1].usage
    else:
        r = client.completions.create(**kw)
        (c,) = r.choices
        text, finish, usage = c.text, [c.finish_reason], r.usage
        lps = c.logprobs.token_logprobs if c.logprobs else []
        assert ("prompt_logprobs" in c.model_extra and c.model_extra["prompt_logprobs"] is not None) == bool(logprobs)
    assert text == PROMPT and finish == ["length"]
    assert usage.completion_tokens == 0 and usage.prompt_tokens == len(ids)
    if logprobs:
        assert len(lps) == len(ids) and lps[0] is None
        assert max(abs(lps[i] - float(lsm[i - 1, ids[i]])) for i in range(1, len(ids))) < TOL


def test_prompt_logprobs_with_max_tokens_zero(client, model, ref):
    ids, lsm = ref
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=0, extra_body={"prompt_logprobs": 0})
    (c,) = r.choices
    assert c.text == "" and c.finish_reason == "length" and r.usage.completion_tokens == 0
    _check_prompt_logprobs(c.model_extra["prompt_logprobs"], ids, lsm, 0)


def test_chat_echo(client, model):
    messages = [{"role": "user", "content": "Finish the sentence: the sky is"},
                {"role": "assistant", "content": "The sky is"}]
    extra = {"echo": True, "continue_final_message": True, "add_generation_prompt": False}
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=3, temperature=0, extra_body=extra)
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=3, temperature=0,
                                           extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert r.choices[0].message.content == "The sky is" + plain.choices[0].message.content
    streamed = "".join(c.delta.content or "" for ch in client.chat.completions.create(
        model=model, messages=messages, max_tokens=3, temperature=0, stream=True, extra_body=extra)
        for c in ch.choices)
    assert streamed == r.choices[0].message.content
    # The last message is the user's and the reply the assistant's: nothing to echo.
    r2 = client.chat.completions.create(model=model, messages=messages[:1], max_tokens=2, temperature=0,
                                        extra_body={"echo": True})
    assert not r2.choices[0].message.content.startswith(messages[0]["content"])


@pytest.mark.parametrize("body", [
    {"prompt_logprobs": 21}, {"prompt_logprobs": -1}, {"prompt_logprobs": -2},
    {"prompt_logprobs": 2, "stream": True}, {"max_tokens": 0},
])
@pytest.mark.parametrize("api", ["completions", "chat"])
def test_bad_requests_are_400(client, model, body, api):
    body = dict(body)
    stream = body.pop("stream", False)
    field = "max_tokens" if "max_tokens" in body and "prompt_logprobs" not in body else "prompt_logprobs"
    kw = {"max_tokens": body.pop("max_tokens", 2)}
    with pytest.raises(openai.BadRequestError) as e:
        if api == "completions":
            r = client.completions.create(model=model, prompt=PROMPT, stream=stream, extra_body=body, **kw)
        else:
            r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                               stream=stream, extra_body=body, **kw)
        list(r) if stream else None
    assert e.value.status_code == 400 and e.value.body["param"] == field


def test_n_choices_share_the_prompt_logprobs(client, model, ref):
    """n > 1: the prompt is scored once (by the first choice) and every choice carries it."""
    ids, lsm = ref
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, n=2, temperature=1.0, seed=3,
                                  echo=True, logprobs=1)
    assert len(r.choices) == 2
    plps = [c.model_extra["prompt_logprobs"] for c in r.choices]
    assert plps[0] == plps[1]
    _check_prompt_logprobs(plps[0], ids, lsm, 1)
    for c in r.choices:
        assert c.logprobs.token_logprobs[0] is None and None not in c.logprobs.token_logprobs[1:]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_honours_return_tokens_as_token_ids(client, model, ref, stream):
    """vLLM-test finding: the echoed prompt's tokens are "token_id:N" too (they were text)."""
    ids, _ = ref
    kw = dict(model=model, prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=1,
              extra_body={"return_tokens_as_token_ids": True})
    if stream:
        tokens, tops = [], []
        for chunk in client.completions.create(stream=True, **kw):
            for c in chunk.choices:
                if c.logprobs is not None:
                    tokens += c.logprobs.tokens
                    tops += c.logprobs.top_logprobs
    else:
        (c,) = client.completions.create(**kw).choices
        tokens, tops = c.logprobs.tokens, c.logprobs.top_logprobs
    assert tokens[:len(ids)] == [f"token_id:{i}" for i in ids]
    assert all(t.startswith("token_id:") for t in tokens[len(ids):]) and len(tokens) == len(ids) + 2
    assert all(k.startswith("token_id:") for top in tops if top for k in top)
