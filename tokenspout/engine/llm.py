"""The offline API: `LLM(model=None).generate(prompts, SamplingParams(...))`.

By default the engine core runs in its own process (SyncMPClient), so detokenisation here overlaps the model step
there; `multiprocess=False` keeps it in this process (InprocClient).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Self, cast

from tokenspout.checks import is_int
from tokenspout.config import (
    CACHE_DEFAULTS,
    SCHEDULER_DEFAULTS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    read_hf_config,
)
from tokenspout.engine.beam_search import BeamSearch, to_request_outputs
from tokenspout.engine.chat_template import load_chat_template
from tokenspout.engine.chat_tools import (
    constrain,
    effective_template,
    plan_chat,
    special_token_ids,
    template_tool_messages,
    tools_template,
)
from tokenspout.engine.core_client import InprocClient, SyncMPClient
from tokenspout.engine.output_processor import OutputProcessor
from tokenspout.engine.processor import Processor, read_generation_config
from tokenspout.engine.tokenizer import load_tokenizer
from tokenspout.models.default_model import resolve_model_path  # not loader: the frontend never imports torch
from tokenspout.models.gguf_file import default_quantization, is_gguf
from tokenspout.outputs import RequestOutput
from tokenspout.reasoning import reasoning_parser_class
from tokenspout.reasoning.budget import apply_budget
from tokenspout.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int]


def build_engine_config(model: str | None = None, *, dtype: str = "float32", quantization: str | None = None,
                        max_model_len: int | None = None,
                        kv_cache_memory: float = CACHE_DEFAULTS.kv_cache_memory_gib,
                        kv_cache_dtype: str = CACHE_DEFAULTS.kv_cache_dtype,
                        block_size: int = CACHE_DEFAULTS.block_size,
                        max_num_seqs: int = SCHEDULER_DEFAULTS.max_num_seqs,
                        max_num_batched_tokens: int = SCHEDULER_DEFAULTS.max_num_batched_tokens,
                        num_kv_blocks: int | None = None,
                        served_model_name: str | None = None, num_threads: int | None = None,
                        speculative: str | None = None, num_speculative_tokens: int = 4, ngram_min: int = 2,
                        ngram_max: int = 4, enable_prefix_caching: bool = True, draft_model: str | None = None,
                        draft_layers: int | None = None, adaptive_speculation: bool = True,
                        async_scheduling: bool = False, generation_config: str = "auto",
                        chat_template: str | None = None, data_parallel_size: int = 1,
                        tokenizer: str | None = None, engine_hang_timeout: float = 30.0,
                        engine_restart: bool = True, activation_quant: str = "int16",
                        batch_invariant: bool = False) -> EngineConfig:
    """quantization: None serves a GGUF file in its own format (what the server's `--quantization auto` picks for
    it: a quantized file is never dequantized to float32 unless asked) and any other model with its float weights;
    "none" asks for float weights for a GGUF file too."""
    path, name = resolve_model_path(model)  # converts the default model here, once, before any engine starts
    if quantization == "none":
        quantization = None
    elif quantization is None and model is not None and is_gguf(Path(model)):
        quantization = default_quantization(Path(model).expanduser())
    if tokenizer is not None:
        tok_path = Path(tokenizer).expanduser()
        if not (tok_path / "tokenizer.json").is_file() and not (tok_path / "tokenizer_config.json").is_file():
            raise ValueError(f"tokenizer: {tok_path} is not a folder with tokenizer.json / tokenizer_config.json")
        tokenizer = str(tok_path.resolve())
    if draft_model is not None:
        draft_path = Path(draft_model).expanduser()
        read_hf_config(draft_path)  # a missing folder or unsupported architecture fails here, not in the engine
        draft_model = str(draft_path.resolve())
    cfg = EngineConfig(
        model=ModelConfig(model=str(path), dtype=dtype, quantization=quantization, max_model_len=max_model_len,
                          generation_config=generation_config,
                          # the default model and a GGUF file are served under their own names (not the folder's)
                          served_model_name=served_model_name or (name if model is None or path.name != name
                                                                  else None),
                          chat_template=load_chat_template(chat_template), tokenizer=tokenizer,
                          activation_quant=activation_quant, batch_invariant=batch_invariant),
        cache=CacheConfig(block_size=block_size, kv_cache_memory_gib=kv_cache_memory, kv_cache_dtype=kv_cache_dtype,
                          num_gpu_blocks_override=num_kv_blocks, enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  async_scheduling=async_scheduling),
        speculative=SpeculativeConfig(method=speculative, num_speculative_tokens=num_speculative_tokens,
                                      ngram_min=ngram_min, ngram_max=ngram_max, draft_model=draft_model,
                                      draft_layers=draft_layers, adaptive=adaptive_speculation),
        num_threads=num_threads, data_parallel_size=data_parallel_size, engine_hang_timeout_s=engine_hang_timeout,
        engine_restart=engine_restart)
    cfg.validate()
    return cfg


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (a string, or one list of token ids) or several, as a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [cast("list[int]", prompts)]  # one prompt of ids; the Processor checks that every item is one
    return list(cast("Sequence[Prompt]", prompts))


def _first_logprobs(out: RequestOutput) -> dict[int, float]:
    """The next-token logprobs a beam search step asked for (max_tokens=1 with logprobs)."""
    logprobs = out.outputs[0].logprobs
    assert logprobs is not None, "beam search steps ask for logprobs"
    return {t: lp.logprob for t, lp in logprobs[0].items()}


class LLM:
    def __init__(self, model: str | None = None, *, multiprocess: bool = True, on_wait=None, **engine_kwargs):
        self.config = build_engine_config(model, **engine_kwargs)
        if self.config.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 is a server option (tokenspout serve); LLM runs one engine")
        self.client: SyncMPClient | InprocClient
        if multiprocess:
            # Start the engine process first: it loads the model while this process loads the tokenizer.
            self.client = SyncMPClient(self.config, wait=False)
            try:
                self.tokenizer = load_tokenizer(self.config.model.tokenizer_folder())
                info = self.client.wait_ready(on_wait)
            except BaseException:
                self.client.shutdown()
                raise
        else:
            self.tokenizer = load_tokenizer(self.config.model.tokenizer_folder())
            self.client = InprocClient(self.config)
            info = self.client.info
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.processor = Processor(self.tokenizer, info.max_model_len, info.vocab_size,
                                   generation_config=read_generation_config(self.config.model.folder()),
                                   chat_template=self.config.model.chat_template)
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=False)
        self._ids = itertools.count()
        self._shut_down = False

    # ---- public API ----------------------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order (a single prompt may be a string or a list of token ids)."""
        batch = _prompt_list(prompts)
        params = sampling_params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(batch)
        if len(plist) != len(batch):
            raise ValueError(f"got {len(plist)} sampling params for {len(batch)} prompts")
        ids = self._add_all(batch, plist)
        results: dict[str, RequestOutput] = {}
        for out in self._run(set(ids)):
            results[out.request_id] = out
        return [results[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             add_generation_prompt: bool = True, *, tools: list[dict] | None = None,
             tool_choice: str | dict | None = None, parallel_tool_calls: bool | None = None,
             tool_call_parser: str | None = "auto", reasoning_parser: str | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Chat prompts through the chat template.  With `tools` (OpenAI's function definitions) the template gets
        them and each output's `message` holds the parsed reply (content, tool_calls in OpenAI's shape); the
        calls are constrained as on the server (tool_choice "auto" / "required" / "none" / a named function; see
        README, Tool calling).  `reasoning_parser` ("deepseek_r1", "qwen3") splits the reasoning into
        `message.reasoning`."""
        # One conversation (a list of messages) or several; the Processor checks each message's shape.
        convs = ([cast("list[dict]", messages)] if messages and isinstance(messages[0], dict)
                 else cast("list[list[dict]]", messages))
        kwargs = dict(chat_template_kwargs or {})
        fallback = tools_template(self.processor, kwargs.get("chat_template"), tools)
        if fallback is not None:
            kwargs["chat_template"] = fallback
        plan = plan_chat(tools, tool_choice, parallel_tool_calls, parser_name=tool_call_parser,
                         template=effective_template(self.processor, kwargs.get("chat_template")),
                         template_kwargs=kwargs)
        convs = [template_tool_messages(c) for c in convs] if tools else convs
        prompts = [self.processor.apply_chat_template(c, add_generation_prompt=add_generation_prompt, **kwargs)
                   for c in convs]
        params = sampling_params or SamplingParams()
        if params.uses_guidance and params.negative_prompt is None:
            # CFG's default unconditional prompt for chat: the template around an empty user message.
            params = dataclasses.replace(params, negative_prompt=self.processor.apply_chat_template(
                [{"role": "user", "content": ""}], add_generation_prompt=add_generation_prompt))
        reasoning_cls = reasoning_parser_class(reasoning_parser)
        plans = [dataclasses.replace(plan, reasoning=reasoning_cls(str(p)) if reasoning_cls else None)
                 for p in prompts]
        specials = special_token_ids(self.tokenizer)
        plist = []
        for plan in plans:
            p = dataclasses.replace(params)
            constrain(p, plan.tool_parser, tools, tool_choice, parallel_tool_calls, plan.reasoning, specials)
            apply_budget(p, plan.reasoning)
            plist.append(p)
        outs = self.generate(prompts, plist)
        for out, plan in zip(outs, plans):
            if plan.active:
                for c in out.outputs:
                    c.message = plan.final(c.text)
        return outs

    def beam_search(self, prompts: Prompt | Sequence[Prompt], width: int = 4, max_tokens: int = 16,
                    length_penalty: float = 1.0, n: int | None = None) -> list[RequestOutput]:
        """Beam search (transformers' semantics with early stopping); each RequestOutput holds the n (default:
        width) best finished beams, best first, with their cumulative logprobs."""
        if n is not None and (not is_int(n) or not 1 <= n <= width):
            raise ValueError(f"n must be an integer in [1, width={width}] (the beams kept), got {n!r}")
        ids = [self.processor.tokenize(p) for p in _prompt_list(prompts)]
        if not ids:
            return []
        room = SamplingParams(max_tokens=max_tokens)  # a max_tokens past a prompt's room is an error, as in generate
        search = BeamSearch(ids, width, min(self.processor.max_tokens_for(room, len(i)) for i in ids),
                            self.processor.eos_token_id, length_penalty)
        params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * width, ignore_eos=True,
                                detokenize=False)
        while not search.done:
            outs = self.generate(search.pending(), params)
            search.step([_first_logprobs(o) for o in outs])
        return to_request_outputs(search, [str(next(self._ids)) for _ in ids], ids, n or width,
                                  lambda t: self.tokenizer.decode(t, skip_special_tokens=True))

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yields the new text of one request as it is produced."""
        params = sampling_params or SamplingParams()
        rid = self._add(prompt, params, RequestOutputKind.DELTA)
        for out in self._run({rid}):
            for c in out.outputs:
                if c.text:
                    yield c.text

    def get_tokenizer(self):
        return self.tokenizer

    def shutdown(self) -> None:
        self._shut_down = True
        self.client.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- internals -----------------------------------------------------------------------------------------
    def _add_all(self, batch: list[Prompt], plist: list[SamplingParams]) -> list[str]:
        """Adds the batch's requests; when one is refused (bad input), those already added are aborted before the
        error is raised (they ran on, unanswered, to the end of the context)."""
        ids: list[str] = []
        try:
            for p, sp in zip(batch, plist):
                ids.append(self._add(p, sp, RequestOutputKind.FINAL_ONLY))
        except BaseException:
            if ids:
                self.client.abort_requests(self.output_processor.abort_requests(ids))
            raise
        return ids

    def _add(self, prompt: Prompt, params: SamplingParams, kind: RequestOutputKind) -> str:
        if getattr(self, "_shut_down", False):  # (the engine's sockets are closed: a ZMQError said nothing of why)
            raise RuntimeError("this LLM was shut down; create a new one")
        rid = str(next(self._ids))
        params = dataclasses.replace(params, output_kind=kind)
        self.output_processor.add_processed(self.processor.process(rid, prompt, params, time.time()), self.client)
        return rid

    def _run(self, pending: set[str]) -> Iterator[RequestOutput]:
        while pending:
            outs = self.client.get_output()
            times = {t.request_id: t for t in outs.request_timestamps} if outs.request_timestamps else None
            processed = self.output_processor.process_outputs(outs.outputs, outs.timestamp, times)
            self.client.abort_requests(processed.reqs_to_abort)
            for ro in processed.request_outputs:
                yield ro
                if ro.finished:
                    pending.discard(ro.request_id)
