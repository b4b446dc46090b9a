"""Chat prompts get exactly one BOS: the chat template writes it, so the rendered text is encoded with
add_special_tokens=False (vLLM's rule), while a plain completion prompt keeps the tokenizer's rule (its
post-processor's BOS).

The tokenizer is built here, Llama-3 style: a post-processor that prepends <|begin_of_text|> AND a chat template that
writes <|begin_of_text|> itself.  Oracle: transformers' own apply_chat_template(tokenize=True).  Paths: the
Processor, AsyncLLM.generate (what /v1/chat/completions runs) with /tokenize beside it, and the offline LLM.chat.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping

import pytest
from starlette.testclient import TestClient

from tokenspout.config import EngineConfig
from tokenspout.engine.async_llm import AsyncLLM
from tokenspout.offload import Offloader
from tokenspout.engine.llm import LLM
from tokenspout.engine.messages import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from tokenspout.engine.output_processor import OutputProcessor
from tokenspout.engine.processor import ChatPrompt, Processor
from tokenspout.entrypoints.openai.api_server import build_app
from tokenspout.sampling_params import SamplingParams

BOS, EOT = "<|begin_of_text|>", "<|eot_id|>"
WORDS = ["user", "assistant", "system", ":", "hello", "world", "be", "brief", "hi"]
TEMPLATE = (BOS + "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} " + EOT + " {% endfor %}"
            "{% if add_generation_prompt %}assistant :{% endif %}")
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def hf_tokenizer():
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([BOS, EOT, "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(BOS, special=True), AddedToken(EOT, special=True)])
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                       special_tokens=[(BOS, vocab[BOS])])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOT, unk_token="<unk>")
    hf.chat_template = TEMPLATE
    return hf


def bos_id(hf) -> int:
    return hf.convert_tokens_to_ids(BOS)


def oracle_chat_ids(hf, messages=MESSAGES) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = out["input_ids"] if isinstance(out, Mapping) else out
    return list(ids)


def test_the_tokenizer_really_adds_bos_and_the_oracle_has_one(hf_tokenizer):
    # Preconditions: without them the tests below could not fail.
    assert hf_tokenizer.encode("hello world")[0] == bos_id(hf_tokenizer)
    ids = oracle_chat_ids(hf_tokenizer)
    assert ids.count(bos_id(hf_tokenizer)) == 1 and ids[0] == bos_id(hf_tokenizer)


def make_processor(hf, **kw) -> Processor:
    return Processor(hf, max_model_len=128, vocab_size=len(hf), generation_config={}, **kw)


def test_processor_chat_prompt_has_one_bos_and_completion_prompt_keeps_its_bos(hf_tokenizer):
    p = make_processor(hf_tokenizer)
    bos = bos_id(hf_tokenizer)
    chat = p.apply_chat_template(MESSAGES)
    assert isinstance(chat, ChatPrompt) and chat.startswith(BOS)
    (req,), text, _ = p.process("c", chat, SamplingParams(max_tokens=1))
    assert req.prompt_token_ids == oracle_chat_ids(hf_tokenizer)
    assert req.prompt_token_ids.count(bos) == 1
    assert type(text) is str  # the marker does not leak into outputs
    (req,), _, _ = p.process("p", "hello world", SamplingParams(max_tokens=1))
    assert req.prompt_token_ids == [bos, *hf_tokenizer.convert_tokens_to_ids(["hello", "world"])]
    # An explicit choice still wins: this is the double BOS the default avoids.
    assert p.tokenize(chat, add_special_tokens=True).count(bos) == 2
    assert p.tokenize(str(chat)).count(bos) == 2  # plain text: the tokenizer's rule, whatever it holds


def test_cfg_default_negative_prompt_of_a_chat_has_one_bos(hf_tokenizer):
    p = make_processor(hf_tokenizer)
    neg = p.apply_chat_template([{"role": "user", "content": ""}])
    (req,), _, _ = p.process("g", p.apply_chat_template(MESSAGES),
                          SamplingParams(max_tokens=1, guidance_scale=1.5, negative_prompt=neg))
    assert req.sampling_params.negative_prompt_token_ids.count(bos_id(hf_tokenizer)) == 1


def test_chat_template_override_is_used_without_touching_the_tokenizer(hf_tokenizer):
    p = make_processor(hf_tokenizer, chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}")
    assert p.apply_chat_template(MESSAGES) == "be brief hello world "
    assert hf_tokenizer.chat_template == TEMPLATE


# ---- the engine frontends, over a fake engine core that finishes every request with one token ----------------


class FakeCore:
    """Meets what AsyncLLM and LLM need of an engine client; records the requests it is given."""

    is_alive = True
    dead_reason = None

    def __init__(self) -> None:
        self.requests: list = []
        self._ready: list[EngineCoreOutput] = []
        self._wake: asyncio.Event | None = None
        self._wake_loop: asyncio.AbstractEventLoop | None = None

    def add_request(self, req) -> None:
        self.requests.append(req)
        self._ready.append(EngineCoreOutput(req.request_id, [3], finish_reason="length"))
        if self._wake is not None:
            self._wake.set()

    def abort_requests(self, ids) -> None:
        pass

    def get_output(self) -> EngineCoreOutputs:
        out, self._ready = self._ready, []
        return EngineCoreOutputs(outputs=out)

    async def get_output_async(self) -> EngineCoreOutputs:
        loop = asyncio.get_running_loop()
        if self._wake is None or self._wake_loop is not loop:  # TestClient runs each request in a loop of its own
            self._wake, self._wake_loop = asyncio.Event(), loop
        while not self._ready:
            self._wake.clear()
            await self._wake.wait()
        return self.get_output()

    def shutdown(self) -> None:
        pass


def fake_async_llm(hf) -> AsyncLLM:
    """The real AsyncLLM frontend (Processor, OutputProcessor, output handler) over FakeCore."""
    llm = object.__new__(AsyncLLM)
    llm.client, llm.tokenizer = FakeCore(), hf
    llm.model_name, llm.max_model_len, llm.vocab_size, llm.num_kv_blocks = "tiny", 128, len(hf), 1
    llm.processor = make_processor(hf)
    llm.output_processor = OutputProcessor(hf, log_stats=True)
    llm.scheduler_stats, llm.stats_listeners, llm._handler, llm._dead = SchedulerStats(), [], None, None
    llm.config, llm.default_sampling_params = EngineConfig(), {}
    llm._prep = Offloader("test-process")
    return llm


def test_chat_completion_and_tokenize_count_one_bos(hf_tokenizer):
    engine = fake_async_llm(hf_tokenizer)
    client = TestClient(build_app(engine))
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1})
    assert r.status_code == 200, r.text
    sent = engine.client.requests[-1].prompt_token_ids
    assert sent == oracle_chat_ids(hf_tokenizer)
    assert r.json()["usage"]["prompt_tokens"] == len(sent)
    t = client.post("/tokenize", json={"messages": MESSAGES}).json()
    assert t["tokens"] == sent and t["count"] == len(sent) and t["max_model_len"] == 128
    # The completion route and /tokenize of a text prompt keep the post-processor's BOS.
    r = client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert engine.client.requests[-1].prompt_token_ids[0] == bos_id(hf_tokenizer)
    t = client.post("/tokenize", json={"prompt": "hello world"}).json()
    assert t["tokens"] == engine.client.requests[-1].prompt_token_ids
    assert client.post("/tokenize", json={"messages": MESSAGES, "add_special_tokens": True}).json()["count"] == \
        len(sent) + 1  # vLLM's switch: BOS on top of the template's


def test_offline_llm_chat_has_one_bos(hf_tokenizer):
    llm = object.__new__(LLM)
    llm.client, llm.tokenizer, llm.model_name, llm.max_model_len = FakeCore(), hf_tokenizer, "tiny", 128
    llm.processor = make_processor(hf_tokenizer)
    llm.output_processor = OutputProcessor(hf_tokenizer, log_stats=False)
    llm._ids = itertools.count()
    (out,) = llm.chat(MESSAGES, SamplingParams(max_tokens=1))
    assert out.prompt_token_ids == oracle_chat_ids(hf_tokenizer)
    (out,) = llm.generate("hello world", SamplingParams(max_tokens=1))
    assert out.prompt_token_ids[0] == bos_id(hf_tokenizer)
