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


def test_no_repeat_ngram_greedy_matches_transformers(llm, hf_model, tokenizer):
    """no_repeat_ngram_size through the engine: greedy text equal to transformers' generate with the same knob."""
    import torch

    prompt = "The list: apple, pear, apple, pear, apple, pear, apple,"
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, no_repeat_ngram_size=3,
                                              ignore_eos=True))[0].outputs[0]
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = hf_model.generate(ids, max_new_tokens=16, do_sample=False, no_repeat_ngram_size=3,
                                pad_token_id=2)[0, ids.shape[1]:].tolist()
    assert len(ref) >= 8 and out.token_ids[:len(ref)] == ref  # transformers stops at EOS, ours ignores it


def test_dry_breaks_a_loop_greedily(llm):
    """A prompt that invites a loop: greedy continues it; with DRY the continuation of the repeat is penalised."""
    prompt = "one two three four one two three four one two three four one two three"
    plain = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0].outputs[0].text
    dry = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, dry_multiplier=2.0))
    assert plain.startswith(" four") and not dry[0].outputs[0].text.startswith(" four")


def test_new_knobs_seeded_batch_invariant(llm):
    """Warpers, XTC, DRY and mirostat through the engine process: a seeded request's text alone equals its text in a
    batch beside other kinds of rows (its state -- mirostat's mu -- is its own)."""
    prompt = "Write a short story about a lighthouse keeper."
    kinds = [SamplingParams(typical_p=0.9, xtc_probability=0.5, top_n_sigma=1.5, seed=7, max_tokens=16),
             SamplingParams(mirostat=2, mirostat_tau=4.0, seed=8, max_tokens=16),
             SamplingParams(mirostat=1, seed=9, max_tokens=16, dry_multiplier=0.8),
             SamplingParams(epsilon_cutoff=3e-4, eta_cutoff=2e-3, dynatemp_range=0.5, seed=10, max_tokens=16)]
    alone = [llm.generate(prompt, p)[0].outputs[0].text for p in kinds]
    fillers = [SamplingParams(temperature=0.7, top_p=0.9, max_tokens=16, seed=i) for i in range(4)]
    batch = llm.generate([prompt] * 4 + ["Tell me about the moon."] * 4, kinds + fillers)
    assert [r.outputs[0].text for r in batch[:4]] == alone


def test_thinking_token_budget_forces_the_end_marker(llm, tokenizer):
    """With a reasoning parser (deepseek_r1: the reply starts inside the reasoning), after the budget the reply's
    next tokens are `</think>` and the rest is the answer; without one, a ValueError that says why."""
    end = tokenizer.encode("</think>", add_special_tokens=False)
    msgs = [{"role": "user", "content": "Count to twenty."}]
    for budget in (0, 6):
        out = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=budget + len(end) + 6, ignore_eos=True,
                                            thinking_token_budget=budget), reasoning_parser="deepseek_r1")[0]
        c = out.outputs[0]
        assert c.token_ids[budget:budget + len(end)] == end
        assert (c.message.reasoning or "") == tokenizer.decode(c.token_ids[:budget]) and c.message.content
    with pytest.raises(ValueError, match="reasoning parser"):
        llm.generate("hi", SamplingParams(thinking_token_budget=4))


def test_thinking_budget_then_the_grammar_applies_to_the_answer(llm, tokenizer):
    """A forced end of reasoning followed by a grammar-constrained answer: the answer (after `</think>`) matches the
    regex, the reasoning before it is unconstrained and exactly `budget` tokens long."""
    import re

    from tokenspout.sampling_params import StructuredOutputsParams

    end = tokenizer.encode("</think>", add_special_tokens=False)
    out = llm.chat([{"role": "user", "content": "Pick a number."}],
                   SamplingParams(temperature=0.0, max_tokens=24, thinking_token_budget=5,
                                  structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}")),
                   reasoning_parser="deepseek_r1")[0].outputs[0]
    assert out.token_ids[5:5 + len(end)] == end
    assert re.fullmatch(r"\s*[0-9]{3}", out.message.content), out.text
