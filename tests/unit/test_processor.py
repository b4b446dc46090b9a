"""Processor: prompt validation and tokenization, params completed from the tokenizer, n fan-out, chat template."""

from __future__ import annotations

import pytest

from tokenspout.engine.output_processor import OutputProcessor
from tokenspout.engine.parallel_sampling import child_seed
from tokenspout.engine.processor import Processor
from tokenspout.sampling_params import SamplingParams

VOCAB = 49152


@pytest.fixture
def proc(tokenizer):
    return Processor(tokenizer, max_model_len=64, vocab_size=VOCAB)


def test_string_prompt_tokenized_without_extra_bos(proc, tokenizer):
    (req,), text, _ = proc.process("a", "Hello world", SamplingParams(max_tokens=5), arrival_time=12.5)
    assert text == "Hello world"
    # SmolLM2's tokenizer adds no BOS by itself, so neither do we.
    assert req.prompt_token_ids == tokenizer.encode("Hello world", add_special_tokens=False)
    assert req.prompt_token_ids[0] != tokenizer.bos_token_id
    assert req.request_id == "a" and req.arrival_time == 12.5
    sp = req.sampling_params
    assert sp.eos_token_id == tokenizer.eos_token_id == 2
    assert sp.max_tokens == 5 and sp.n == 1


def test_token_prompt_passes_through(proc):
    (req,), text, _ = proc.process("a", [5, 6, 7], SamplingParams())
    assert req.prompt_token_ids == [5, 6, 7] and text is None
    assert req.arrival_time > 0  # defaults to now


@pytest.mark.parametrize("prompt, match", [
    ("", "prompt must not be empty"),
    ([], "prompt must not be empty"),
    ([1, VOCAB], f"prompt has token id {VOCAB}, outside the vocabulary"),
    ([-3, 1], "prompt has token id -3"),
    ([1, "x"], "prompt must be a string or a list of integer token ids"),
    (3.5, "prompt must be a string or a list of token ids"),
])
def test_bad_prompts(proc, prompt, match):
    with pytest.raises(ValueError, match=match):
        proc.process("a", prompt, SamplingParams())


def test_a_huge_prompt_is_refused_from_its_prefix(proc, monkeypatch):
    """7 MB against a 64-token context: refused after tokenizing 1,024 characters, not 7 MB."""
    seen: list[int] = []
    encode = proc.tokenizer.encode
    monkeypatch.setattr(proc.tokenizer, "encode", lambda text, **kw: seen.append(len(text)) or encode(text, **kw))
    with pytest.raises(ValueError, match=r"longer than max_model_len .* 64 tokens: its first 1024 of 7000000"):
        proc.process("r", ("lorem ipsum " * 600_000)[:7_000_000], SamplingParams())
    assert seen == [1024]
    # A prompt past that length in characters but not in tokens is tokenized whole and served.
    spaces = " " * 1500  # whitespace runs merge into few tokens
    if len(encode(spaces)) < 64:
        (req,), _, _ = proc.process("s", spaces, SamplingParams(max_tokens=1))
        assert seen[-1] == 1500


def test_prompt_too_long_names_length_and_limit(proc):
    with pytest.raises(ValueError, match=r"prompt is 64 tokens long.*max_model_len.*64"):
        proc.process("a", [7] * 64, SamplingParams())
    (req,), _, _ = proc.process("a", [7] * 63, SamplingParams(max_tokens=None))
    assert req.sampling_params.max_tokens == 1


def test_max_tokens_fill_and_clamp(proc):
    (req,), _, _ = proc.process("a", [7] * 10, SamplingParams(max_tokens=None))
    assert req.sampling_params.max_tokens == 54
    # A default the client did not choose is cut to the room left (min_tokens with it) ...
    (req,), _, _ = proc.process("a", [7] * 10, SamplingParams(max_tokens=1000, min_tokens=40, clamp_max_tokens=True))
    assert req.sampling_params.max_tokens == 54 and req.sampling_params.min_tokens == 40
    # ... one the client chose is a 400 naming the prompt length and max_model_len, as OpenAI and vLLM answer.
    with pytest.raises(ValueError, match=r"^max_tokens .* 1000\. .*max_model_len\) is 64 .* prompt has 10 tokens"):
        proc.process("a", [7] * 10, SamplingParams(max_tokens=1000))
    with pytest.raises(ValueError, match=r"^min_tokens is too large: 55"):
        proc.process("a", [7] * 10, SamplingParams(max_tokens=None, min_tokens=55))
    (req,), _, _ = proc.process("a", [7] * 10, SamplingParams(max_tokens=54, min_tokens=54))
    assert req.sampling_params.max_tokens == 54


def test_truncate_prompt_tokens(proc):
    ids = list(range(3, 23))  # 20 tokens
    (req,), _, _ = proc.process("a", ids, SamplingParams(truncate_prompt_tokens=5))
    assert req.prompt_token_ids == ids[-5:]
    (req,), _, _ = proc.process("a", ids, SamplingParams(truncate_prompt_tokens=5, truncation_side="right"))
    assert req.prompt_token_ids == ids[:5]
    (req,), _, _ = proc.process("a", ids, SamplingParams(truncate_prompt_tokens=50))
    assert req.prompt_token_ids == ids
    # -1: as much as leaves room for max_tokens (64 - 10)
    (req,), _, _ = proc.process("a", list(range(3, 103)), SamplingParams(truncate_prompt_tokens=-1, max_tokens=10))
    assert req.prompt_token_ids == list(range(3, 103))[-54:] and req.sampling_params.max_tokens == 10
    with pytest.raises(ValueError, match="^truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
    (req,), _, _ = proc.process("a", [7] * 10, SamplingParams(max_tokens=20, min_tokens=3))
    assert (req.sampling_params.max_tokens, req.sampling_params.min_tokens) == (20, 3)


@pytest.mark.parametrize("params, field", [
    ({"logit_bias": {VOCAB + 1: 1.0}}, "logit_bias"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"allowed_token_ids": [0, VOCAB]}, "allowed_token_ids"),
    ({"stop": ["x"], "detokenize": False}, "stop"),
    ({"bad_words": ["  "]}, "bad_words"),
])
def test_param_errors_name_the_field(proc, params, field):
    with pytest.raises(ValueError, match=field):
        proc.process("a", "hi", SamplingParams(**params))


def test_request_id_required(proc):
    with pytest.raises(ValueError, match="request_id"):
        proc.process("", "hi", SamplingParams())


def test_bad_words_with_and_without_leading_space(proc, tokenizer):
    (req,), _, _ = proc.process("a", "hi", SamplingParams(bad_words=["hello", " world peace"]))
    def enc(s: str) -> list[int]:
        return tokenizer.encode(s, add_special_tokens=False)

    assert req.sampling_params.bad_words_token_ids == [enc("hello"), enc(" hello"), enc("world peace"),
                                                       enc(" world peace")]


def test_generation_config_eos_joins_stop_ids(tokenizer):
    proc = Processor(tokenizer, 64, VOCAB, generation_config={"eos_token_id": [2, 0]})
    (req,), _, _ = proc.process("a", "hi", SamplingParams(stop_token_ids=[9]))
    assert req.sampling_params.eos_token_id == 2 and req.sampling_params.stop_token_ids == [9, 0]
    (req,), _, _ = proc.process("a", "hi", SamplingParams(ignore_eos=True))
    assert req.sampling_params.stop_token_ids == []


def test_reads_generation_config_from_model_folder(tokenizer):
    proc = Processor(tokenizer, 64, VOCAB)  # the default model folder has generation_config.json (eos 2)
    assert proc.eos_token_id == 2 and proc.extra_eos_token_ids == []


def test_caller_params_not_mutated(proc):
    params = SamplingParams(max_tokens=None, bad_words=["x"], n=2, seed=3)
    proc.process("a", "hi", params)
    assert params.max_tokens is None and params.bad_words_token_ids is None and params.eos_token_id is None
    assert params.n == 2 and params.seed == 3


def test_n_fan_out_ids_and_seeds(proc):
    reqs, _, _ = proc.process("req", "hi", SamplingParams(n=3, seed=42, temperature=0.8))
    assert [r.request_id for r in reqs] == ["0_req", "1_req", "2_req"]
    seeds = [r.sampling_params.seed for r in reqs]
    assert seeds[0] == 42 and len(set(seeds)) == 3
    assert seeds == [child_seed(42, i) for i in range(3)]
    assert all(0 <= s < 2**63 for s in seeds)
    assert all(r.sampling_params.n == 1 and r.sampling_params.temperature == 0.8 for r in reqs)
    assert reqs[0].prompt_token_ids == reqs[1].prompt_token_ids and reqs[0].prompt_token_ids is not \
        reqs[1].prompt_token_ids
    again, _, _ = proc.process("other", "hi", SamplingParams(n=3, seed=42))
    assert [r.sampling_params.seed for r in again] == seeds  # deterministic in (seed, index)
    unseeded, _, _ = proc.process("u", "hi", SamplingParams(n=2))
    assert [r.sampling_params.seed for r in unseeded] == [None, None]


def test_add_processed_registers_children_then_engine(proc, tokenizer):
    class Client:
        def __init__(self):
            self.added = []

        def add_request(self, req):
            assert op.get_num_unfinished_requests() == 2  # the output side knows every child before the engine
            self.added.append(req.request_id)

    op = OutputProcessor(tokenizer)
    client = Client()
    processed = proc.process("p", "hi", SamplingParams(n=2))
    assert processed.parent is not None and processed.parent.child_request_ids == ["0_p", "1_p"]
    ids = op.add_processed(processed, client)
    assert ids == client.added == ["0_p", "1_p"]
    assert op.abort_requests(["p"]) == ["0_p", "1_p"]


def test_chat_template(proc, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = proc.apply_chat_template(messages)
    assert text == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert "a\nb" in proc.apply_chat_template(parts, add_generation_prompt=False)


@pytest.mark.parametrize("messages, match", [
    ([], "messages must be a non-empty list"),
    ("hi", "messages must be a non-empty list"),
    ([{"role": "wizard", "content": "x"}], r"messages\[0\]\.role must be one of"),
    ([{"content": "x"}], r"messages\[0\]\.role"),
    (["hi"], r"messages\[0\] must be an object"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], r"messages\[0\]\.content\[0\]"),
    ([{"role": "user", "content": 5}], r"messages\[0\]\.content"),
])
def test_chat_template_errors(proc, messages, match):
    with pytest.raises(ValueError, match=match):
        proc.apply_chat_template(messages)
