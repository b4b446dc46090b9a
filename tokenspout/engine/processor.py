"""Processor: a user prompt + SamplingParams in, validated EngineCoreRequest(s) out.

What it decides (vLLM semantics unless noted):
* A string prompt is encoded with the tokenizer's own special-token rule (`add_special_tokens=True` adds a BOS only
  if the tokenizer's post-processor does so); chat prompts come from `apply_chat_template` as a `ChatPrompt` and are
  encoded with `add_special_tokens=False` since the template already holds every special token (else a Llama-3
  style tokenizer gets two BOS).  An explicit add_special_tokens overrides either rule.
* `chat_template` (the --chat-template flag) replaces the tokenizer's own template.
* The prompt must be non-empty, use ids inside the model's vocabulary, and leave room for at least one generated
  token: len(prompt) >= max_model_len is a ValueError.
* max_tokens None means "fill the context": max_model_len - len(prompt).  A max_tokens (or min_tokens) that would
  run past the context is a ValueError naming the prompt length and max_model_len (as OpenAI and current vLLM
  answer), unless `clamp_max_tokens` says the value is a default the client did not choose: then it is cut to the
  room left (and min_tokens with it).
* truncate_prompt_tokens keeps the last (truncation_side "left") or first k prompt tokens before any check.
* eos_token_id comes from the tokenizer; further EOS ids of generation_config.json (e.g. Llama 3's <|end_of_text|>
  next to <|eot_id|>) join stop_token_ids unless ignore_eos.
* bad_words are tokenized as written (left-stripped) and with a leading space, since a word mid-text starts with a
  space token in byte-level / sentencepiece vocabularies; both sequences are banned.
* n > 1 is fanned out into n EngineCoreRequests, ids f"{i}_{request_id}", each with n = 1 and its own seed
  (see parallel_sampling).  n = 1 keeps the request id as is.
The caller's SamplingParams object is never mutated: each request carries a copy.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from tokenspout import guidance
from tokenspout.checks import is_int, is_number
from tokenspout.engine.chat_template import TEMPLATE_TIME_LIMIT_S, run_with_time_limit
from tokenspout.engine.messages import EngineCoreRequest
from tokenspout.engine.parallel_sampling import ParentRequest
from tokenspout.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def read_generation_config(model_path: str | Path | None) -> dict[str, Any]:
    """generation_config.json of a local model folder, or {} when there is none."""
    if not model_path:
        return {}
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        logger.warning("ignoring unreadable %s: %s", path, e)
        return {}
    if not isinstance(config, dict):  # (a JSON list had failed the server's start with an AttributeError)
        logger.warning("ignoring %s: not a JSON object", path)
        return {}
    return config


# generation_config.json keys that are request sampling defaults (vLLM's --generation-config auto takes these).
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(generation_config: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling defaults a model folder sets, e.g. {"temperature": 0.6, "top_p": 0.9} (as vLLM, `do_sample` is
    not read: the keys alone decide).  A value outside its range is an error at startup naming the file: it had
    made every request that omits the field a 400 blaming the client ("top_p must be in (0, 1], got 2")."""
    defaults = {k: generation_config[k] for k in SAMPLING_DEFAULT_KEYS if is_number(generation_config.get(k))}
    for key, value in defaults.items():
        try:
            fields: dict[str, Any] = {key: float(value) if key != "top_k" else value}
            SamplingParams(**fields).validate()
        except (ValueError, TypeError) as e:
            raise ValueError(f"generation_config.json of the model: {e} (a sampling default for requests that omit "
                             f"{key}; fix the file, or serve with --generation-config vllm to ignore it)") from None
    return defaults


def _as_id_list(value: Any) -> list[int]:
    """Token ids as a config writes them (one, a list, or none); what is no integer is left out."""
    if value is None:
        return []
    if is_int(value):
        return [value]
    if not isinstance(value, list | tuple):
        return []
    return [v for v in value if is_int(v)]


class ChatPrompt(str):
    """Prompt text rendered by a chat template: it already holds the special tokens (BOS...) the template writes,
    so it is encoded with add_special_tokens=False.  A plain str is a completion prompt."""

    __slots__ = ()


def default_add_special_tokens(prompt: object) -> bool:
    return not isinstance(prompt, ChatPrompt)


class ProcessedRequest(NamedTuple):
    """One user request, validated: what the engine runs and what the OutputProcessor needs to follow it."""

    requests: list[EngineCoreRequest]  # n of them, in choice order
    prompt_text: str | None  # None for a token-id prompt (or one cut by truncate_prompt_tokens)
    parent: ParentRequest | None  # folds the n > 1 children into one output; None when n == 1


_HUGE_PROMPT_CHARS = 16  # characters per context token beyond which a prompt is checked by its prefix first
_CUT_MARGIN_TOKENS = 64


class Processor:
    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int,
                 generation_config: Mapping[str, Any] | None = None, chat_template: str | None = None) -> None:
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.chat_template = chat_template  # None: the tokenizer's own
        if generation_config is None:
            generation_config = read_generation_config(getattr(tokenizer, "name_or_path", None))
        eos_ids = _as_id_list(getattr(tokenizer, "eos_token_id", None))
        for t in _as_id_list(generation_config.get("eos_token_id")):
            if not 0 <= t < vocab_size:  # (it became every request's stop token id: each one a 400)
                logger.warning("generation_config.json: eos_token_id %s is outside the vocabulary (%d): ignored", t,
                               vocab_size)
            elif t not in eos_ids:
                eos_ids.append(t)
        self.eos_token_id: int | None = eos_ids[0] if eos_ids else None
        self.extra_eos_token_ids: list[int] = eos_ids[1:]

    # ---- prompts -----------------------------------------------------------------------------------------------

    def process(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                arrival_time: float | None = None, *, add_special_tokens: bool | None = None) -> ProcessedRequest:
        """Validates and tokenizes one request into its EngineCoreRequests (n of them).  `arrival_time` is
        wall-clock time.time(); None means now.  `add_special_tokens` None: the prompt's own rule (False for a
        ChatPrompt, else True).  Registering the result (OutputProcessor, then engine) is the caller's job:
        OutputProcessor.add_processed."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        prompt_ids, prompt_text = self._prompt_token_ids(prompt, add_special_tokens, params)
        params = self._prepare_params(params, len(prompt_ids))
        arrival = time.time() if arrival_time is None else arrival_time
        if params.n == 1:
            return ProcessedRequest([EngineCoreRequest(request_id, prompt_ids, params, arrival)], prompt_text, None)
        parent = ParentRequest(request_id, params)
        # Each child gets its own list: an in-process engine may hold on to (or extend) it.
        requests = [EngineCoreRequest(cid, list(prompt_ids), parent.child_params(i), arrival)
                    for i, cid in enumerate(parent.child_request_ids)]
        return ProcessedRequest(requests, prompt_text, parent)

    def tokenize(self, prompt: str | Sequence[int], add_special_tokens: bool | None = None) -> list[int]:
        """A prompt (text or token ids) as validated token ids."""
        ids, _ = self._prompt_token_ids(prompt, add_special_tokens)
        return ids

    def _prompt_token_ids(self, prompt: str | Sequence[int], add_special_tokens: bool | None,
                          params: SamplingParams | None = None) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt must be a list of token ids when no tokenizer is loaded")
            if add_special_tokens is None:
                add_special_tokens = default_add_special_tokens(prompt)
            if params is None or params.truncate_prompt_tokens is None:
                self._refuse_huge_prompt(prompt, add_special_tokens)
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
            text: str | None = str(prompt)  # a plain str downstream
        elif isinstance(prompt, Sequence):
            if not all(map(is_int, prompt)):
                raise ValueError("prompt must be a string or a list of integer token ids")
            ids = list(prompt)
            text = None
        else:
            # ValueError, not TypeError: the server maps ValueError to HTTP 400 (a user mistake).
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")  # noqa: TRY004
        if not ids:
            raise ValueError("prompt must not be empty")
        if params is not None and params.truncate_prompt_tokens is not None:
            ids, text = self._truncate(ids, text, params)
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"prompt has token id {bad}, outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens long, but max_model_len (the model's context length) is "
                f"{self.max_model_len} tokens and at least one must be left for generation")
        return ids, text

    def max_tokens_for(self, params: SamplingParams, prompt_len: int) -> int:
        """The tokens a prompt of `prompt_len` may generate under `params`: its max_tokens where that fits the room
        the prompt leaves (an error where it does not), else the room (None: "until the context is full", or a
        default the client did not choose: clamp_max_tokens)."""
        room = self.max_model_len - prompt_len
        max_tokens = params.max_tokens
        if max_tokens is None or (max_tokens > room and params.clamp_max_tokens):
            return room
        if max_tokens > room:
            raise ValueError(
                f"max_tokens (or max_completion_tokens) is too large: {max_tokens}. This model's maximum context "
                f"length (max_model_len) is {self.max_model_len} tokens and the prompt has {prompt_len} tokens "
                f"({max_tokens} > {self.max_model_len} - {prompt_len})")
        return max_tokens

    def _refuse_huge_prompt(self, prompt: str, add_special_tokens: bool) -> None:
        """A prompt far longer than the context in characters is refused from a prefix: tokenizing all of a 7 MB
        prompt took ~14 s (and ~1 GB) only to say it is too long.  Its first HUGE_PROMPT_CHARS x max_model_len
        characters are tokenized; if they alone exceed the context by a margin (a cut can split the last word into
        a few more tokens than the whole text gives there), the whole prompt does too."""
        head_chars = _HUGE_PROMPT_CHARS * self.max_model_len
        if len(prompt) <= head_chars:
            return
        head = len(self.tokenizer.encode(prompt[:head_chars], add_special_tokens=add_special_tokens))
        if head >= self.max_model_len + _CUT_MARGIN_TOKENS:
            raise ValueError(
                f"prompt is longer than max_model_len (the model's context length) of {self.max_model_len} tokens: "
                f"its first {head_chars} of {len(prompt)} characters are {head} tokens already")

    def _truncate(self, ids: list[int], text: str | None, params: SamplingParams) -> tuple[list[int], str | None]:
        """truncate_prompt_tokens: keep k tokens (-1: as many as leave room for max_tokens, or one token)."""
        keep = params.truncate_prompt_tokens
        if keep == -1:
            wanted = params.max_tokens if params.max_tokens is not None and not params.clamp_max_tokens else 1
            keep = max(1, self.max_model_len - wanted)
        assert keep is not None
        if len(ids) <= keep:
            return ids, text
        ids = ids[-keep:] if params.truncation_side == "left" else ids[:keep]
        return ids, None  # the text no longer matches: echo and prompt text come from the kept ids

    # ---- sampling params ---------------------------------------------------------------------------------------

    def _prepare_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        params.validate()
        params.validate_for_vocab(self.vocab_size)
        if params.stop and not params.detokenize:
            raise ValueError("stop strings need detokenize=True (they are matched on the decoded text)")
        if params.structured_outputs is not None:
            from tokenspout.structured_output import validate as validate_grammar

            validate_grammar(params.structured_outputs)  # an invalid schema/regex/grammar is the user's 400
        room = self.max_model_len - prompt_len
        max_tokens = self.max_tokens_for(params, prompt_len)
        if params.min_tokens > room:
            raise ValueError(
                f"min_tokens is too large: {params.min_tokens}. This model's maximum context length (max_model_len) "
                f"is {self.max_model_len} tokens and the prompt has {prompt_len} tokens "
                f"({params.min_tokens} > {self.max_model_len} - {prompt_len})")
        stop_token_ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            stop_token_ids += [t for t in self.extra_eos_token_ids if t not in stop_token_ids]
        return dataclasses.replace(
            params,
            max_tokens=max_tokens,
            min_tokens=min(params.min_tokens, max_tokens),  # a clamped default may fall below min_tokens
            stop=list(params.stop),
            stop_token_ids=stop_token_ids,
            eos_token_id=self.eos_token_id,
            bad_words_token_ids=self._bad_words_token_ids(params.bad_words),
            dry_sequence_breaker_ids=self._dry_breaker_ids(params),
            reasoning_end_token_ids=self._reasoning_marker_ids(params, params.reasoning_end),
            reasoning_start_token_ids=self._reasoning_marker_ids(params, params.reasoning_start),
            negative_prompt_token_ids=self._negative_prompt_ids(params),
            # A plain str from here on: the ChatPrompt subclass has done its job (its tokens are above) and msgspec
            # encodes only exact builtin types across the process boundary.
            negative_prompt=None if params.negative_prompt is None else str(params.negative_prompt),
        )

    def _negative_prompt_ids(self, params: SamplingParams) -> list[int] | None:
        """CFG's unconditional prompt as token ids (tokenspout/guidance.py has the rule)."""
        if not params.uses_guidance:
            return None
        tok = self.tokenizer
        encode = None if tok is None else (
            lambda text: list(tok.encode(text, add_special_tokens=default_add_special_tokens(text))))
        return guidance.negative_prompt_ids(params.negative_prompt, encode, getattr(tok, "bos_token_id", None),
                                            self.eos_token_id, self.max_model_len)

    def _reasoning_marker_ids(self, params: SamplingParams, marker: str | None) -> list[int] | None:
        """A thinking_token_budget marker as token ids (the reasoning parser's text, set by the server or
        LLM.chat)."""
        if params.thinking_token_budget is None:
            return None
        if params.reasoning_end is None:
            raise ValueError("thinking_token_budget needs a reasoning parser to know where the reasoning ends: serve "
                             "with --reasoning-parser, or call LLM.chat(..., reasoning_parser=...)")
        if self.tokenizer is None:
            raise ValueError("thinking_token_budget needs a tokenizer")
        return None if marker is None else list(self.tokenizer.encode(marker, add_special_tokens=False))

    def _dry_breaker_ids(self, params: SamplingParams) -> list[list[int]] | None:
        """DRY's sequence breakers as token sequences (each string tokenized as written, its tail cut to 20 tokens as
        llama.cpp's MAX_SEQ_LEN)."""
        if not params.uses_dry or not params.dry_sequence_breakers:
            return None
        if self.tokenizer is None:
            raise ValueError("dry_sequence_breakers need a tokenizer")
        out: list[list[int]] = []
        for text in params.dry_sequence_breakers:
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))[:21]
            if ids and ids not in out and all(0 <= t < self.vocab_size for t in ids):
                out.append(ids)
        return out

    def _bad_words_token_ids(self, bad_words: Sequence[str] | None) -> list[list[int]] | None:
        if not bad_words:
            return None
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer")
        sequences: list[list[int]] = []
        for word in bad_words:
            if not isinstance(word, str) or not word.strip():
                raise ValueError(f"bad_words must be a list of non-empty strings, got {word!r}")
            core = word.lstrip()
            for variant in (core, " " + core):
                ids = list(self.tokenizer.encode(variant, add_special_tokens=False))
                if ids and ids not in sequences:
                    sequences.append(ids)
        for ids in sequences:
            for t in ids:
                if not 0 <= t < self.vocab_size:
                    raise ValueError(f"bad_words tokenize to id {t}, outside the vocabulary [0, {self.vocab_size})")
        return sequences

    # ---- chat --------------------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> ChatPrompt:
        """Renders OpenAI-style chat messages with the chat template (--chat-template, else the model's).  Text
        content parts are joined with newlines; other part types are rejected.  Errors the user can cause are
        ValueErrors naming the field."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise ValueError("messages must be a non-empty list of {role, content} objects")
        rendered: list[dict[str, Any]] = []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")  # noqa: TRY004
            role = message.get("role")
            if role not in CHAT_ROLES:
                raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {role!r}")
            rendered.append({**message, "content": _content_text(message.get("content"), i)})
        if self.tokenizer is None or not (template_kwargs.get("chat_template") or self.chat_template
                                           or getattr(self.tokenizer, "chat_template", None)):
            raise ValueError("this model has no chat template; use the completions API with a plain prompt "
                             "(or start the server with --chat-template)")
        if self.chat_template and "chat_template" not in template_kwargs:
            # An explicit argument, not a patch on the shared tokenizer object; a request's own template wins.
            template_kwargs = {**template_kwargs, "chat_template": self.chat_template}
        from jinja2 import TemplateError

        try:
            text = run_with_time_limit(lambda: self.tokenizer.apply_chat_template(
                rendered, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs),
                TEMPLATE_TIME_LIMIT_S)  # (the model's template is a file's code too)
        except TemplateError as e:  # e.g. a template that insists on alternating roles
            raise ValueError(f"messages rejected by the chat template: {e}") from e
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
        return ChatPrompt(text)


def _content_text(content: Any, i: int) -> str:
    if content is None:  # e.g. an assistant message that only carried tool calls
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"messages[{i}].content[{j}] must be a text part; got type {kind!r}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
