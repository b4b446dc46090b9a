"""The offline API end to end: LLM over the engine process (SyncMPClient), as users call it."""

from __future__ import annotations

import pytest

from tokenspout import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    engine = LLM(max_model_len=2048, kv_cache_memory=0.25)
    yield engine
    engine.shutdown()


def test_generate_greedy_matches_transformers(llm, hf_model, tokenizer):
    import torch

    prompt = "The capital of France is"
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12))[0]
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = hf_model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=2)[0, ids.shape[1]:].tolist()
    assert out.outputs[0].token_ids == ref
    assert out.outputs[0].text == tokenizer.decode(ref, skip_special_tokens=True)
    assert len(out.prompt_token_ids) == ids.shape[1]
    assert out.outputs[0].finish_reason in ("length", "stop")


def test_chat_template_and_eos_stop(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=64))[0]
    c = out.outputs[0]
    assert "Paris" in c.text
    assert c.finish_reason == "stop"  # ended on EOS, which is not in the text
    assert "<|im_end|>" not in c.text


def test_seeded_sampling_is_batch_invariant(llm):
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=1234, max_tokens=24, ignore_eos=True)
    prompt = "Write a short poem about the ocean."
    alone = llm.generate(prompt, params)[0].outputs[0].text
    again = llm.generate(prompt, params)[0].outputs[0].text
    others = [f"Tell me fact number {i} about space." for i in range(15)]
    batch = llm.generate(others[:7] + [prompt] + others[7:],
                         [SamplingParams(temperature=1.0, max_tokens=24, seed=i) for i in range(7)] + [params]
                         + [SamplingParams(temperature=0.5, top_p=0.5, max_tokens=24) for _ in range(8)])
    assert alone == again
    assert batch[7].outputs[0].text == alone
    other_seed = llm.generate(prompt, SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=99, max_tokens=24,
                                                     ignore_eos=True))[0].outputs[0].text
    assert other_seed != alone


def test_stop_string_and_n(llm):
    out = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0.0, max_tokens=30, stop=[" 7"]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == " 7"
    assert out.text.strip().startswith("5") and " 7" not in out.text
    res = llm.generate("Once upon a time", SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=8))[0]
    assert sorted(c.index for c in res.outputs) == [0, 1, 2]
    assert len({c.text for c in res.outputs}) > 1


def test_bad_input_is_a_value_error(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate("", SamplingParams())
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate("hi", SamplingParams(logit_bias={10**7: 1.0}))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_async_scheduling_in_the_engine_process(llm):
    """The engine process steps with async scheduling: same texts and finish reasons as the synchronous engine,
    with stop strings (frontend aborts arriving while a step is in flight) and across back-to-back calls."""
    prompts = ["Write a short poem about the ocean.", "1, 2, 3, 4,", "The capital of France is", "Hi"] * 2
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=20, stop=[" the", "7"]) for s in range(4)]
    params += [SamplingParams(temperature=0.0, max_tokens=12 + s, logprobs=2) for s in range(4)]
    want = [(c.text, c.finish_reason) for o in llm.generate(prompts, params) for c in o.outputs]
    assert any(r == "stop" for _, r in want)
    with LLM(max_model_len=2048, kv_cache_memory=0.25, async_scheduling=True) as fast:
        for _ in range(2):
            got = [(c.text, c.finish_reason) for o in fast.generate(prompts, params) for c in o.outputs]
            assert got == want


def test_chat_with_tools_returns_parsed_calls(llm):
    """LLM.chat(tools=...): the tool template's calls come back parsed and valid (constrained as on the server)."""
    import json
    from pathlib import Path

    import jsonschema

    template = (Path(__file__).resolve().parents[1] / "data" / "chatml_tools.jinja").read_text()
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    outs = llm.chat([messages, messages], SamplingParams(temperature=1.0, seed=5, max_tokens=48), tools=tools,
                    tool_choice="required", parallel_tool_calls=False, chat_template_kwargs={"chat_template": template})
    for out in outs:
        msg = out.outputs[0].message
        assert msg is not None and len(msg.tool_calls) == 1 and not msg.content
        call = msg.tool_calls[0]
        assert call["type"] == "function" and call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
        assert out.outputs[0].text.startswith("<tool_call>\n")  # the raw text stays in `text`
    own = llm.tokenizer.chat_template  # SmolLM2's own template never reads `tools`: named, it is refused
    with pytest.raises(ValueError, match="does not render tools"):
        llm.chat(messages, tools=tools, chat_template_kwargs={"chat_template": own})
    # left to the default, a ChatML template without tools gets the bundled ChatML tools template
    params = SamplingParams(temperature=0, max_tokens=48)
    [default] = llm.chat(messages, params, tools=tools, tool_choice="required", parallel_tool_calls=False)
    [explicit] = llm.chat(messages, params, tools=tools, tool_choice="required", parallel_tool_calls=False,
                          chat_template_kwargs={"chat_template": template})
    assert default.prompt == explicit.prompt and default.outputs[0].text == explicit.outputs[0].text
