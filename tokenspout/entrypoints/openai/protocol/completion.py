"""/v1/completions (the legacy API): the request (prompt shapes, echo, beam search) and the response."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_serializer, model_validator
from typing_extensions import TypeIs

from tokenspout.engine.beam_search import MAX_BEAM_WIDTH, MAX_LENGTH_PENALTY
from tokenspout.entrypoints.openai.protocol.bounds import request_bounds
from tokenspout.entrypoints.openai.protocol.common import PromptLogprobsJSON, UsageInfo, unix_now
from tokenspout.entrypoints.openai.protocol.errors import OpenAIServingError
from tokenspout.entrypoints.openai.protocol.sampling import SamplingRequest
from tokenspout.sampling_params import MAX_LOGPROBS, SamplingParams


def _is_token_ids(x: object) -> TypeIs[list[int]]:
    """A list of token ids (a JSON true is no id, though Python counts bools as ints: type(True) is bool).  The
    element types are collected in C: a 3M-id prompt is checked in ~0.1 s, not 2 s of the event loop."""
    return isinstance(x, list) and set(map(type, x)) <= _INT


_INT = frozenset({int})


class CompletionRequest(SamplingRequest):
    prompt: list[int] | list[list[int]] | list[str] | str
    max_tokens: int | None = None  # omitted: OpenAI's legacy default, 16 (see to_sampling_params)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    use_beam_search: bool = False  # n = beam width
    add_special_tokens: bool = True  # vLLM extra: the tokenizer's special tokens (BOS) around a text prompt
    length_penalty: float = Field(default=1.0, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY, allow_inf_nan=False)

    @classmethod
    def _check_prompt_count(cls, data: Any) -> None:
        prompt = data.get("prompt") if isinstance(data, dict) else None
        limit = request_bounds().prompts
        # a list of prompts (strings or lists of ids; a flat list of ids is one prompt)
        if isinstance(prompt, list) and len(prompt) > limit and isinstance(prompt[0], list | str):
            raise ValueError(f"prompt: at most {limit} prompts per request, got {len(prompt)} (--max-request-fanout)")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        if isinstance(v, str) or (isinstance(v, list) and (_is_token_ids(v) or all(isinstance(x, str) for x in v)
                                                           or all(_is_token_ids(x) for x in v))):
            return v
        raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of such lists")

    @model_validator(mode="after")
    def _beam_search_fields(self) -> CompletionRequest:
        """Beam search scores the model's raw logprobs and returns text: a field it would silently ignore (stop
        strings, logprobs, a grammar, a sampling knob) is a 400 naming it, as an unknown field is."""
        if not self.use_beam_search:
            return self
        if not 1 <= self.n <= MAX_BEAM_WIDTH:
            raise ValueError(f"n: the beam width must be in [1, {MAX_BEAM_WIDTH}] with use_beam_search, got {self.n}")
        if self.max_tokens == 0:
            raise ValueError("max_tokens: must be at least 1 with use_beam_search")
        if self.temperature not in (None, 0):
            raise ValueError("temperature: beam search scores the raw logprobs; send 0 or leave it out")
        for name in sorted(self.model_fields_set - _BEAM_SEARCH_FIELDS):
            if getattr(self, name) != type(self).model_fields[name].get_default(call_default_factory=True):
                raise ValueError(f"{name}: not supported with use_beam_search")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            prompts: list[str | list[int]] = [p]
        elif _is_token_ids(p):  # [] too: it is refused as an empty prompt below
            prompts = [list(p)]  # one prompt given as token ids
        else:
            prompts = list(p)
        if not prompts or any(isinstance(x, list) and not x for x in prompts):
            raise OpenAIServingError("prompt must not be empty", param="prompt")
        return prompts

    def to_sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        if self.suffix:
            raise OpenAIServingError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise OpenAIServingError("best_of is not supported (it must equal n)", param="best_of")
        for name in ("thinking_token_budget", "reasoning_effort"):
            if getattr(self, name) is not None:
                raise OpenAIServingError(f"{name} applies to chat completions, where the server's reasoning parser "
                                         "knows where the reasoning ends; completions have no reasoning parser",
                                         param=name)
        # OpenAI's legacy default of 16 tokens is cut to the room the prompt leaves; a max_tokens the client chose
        # that does not fit is a 400 (the Processor checks it against the prompt's length).
        # An explicit null means "until the context is full" (as vLLM).
        omitted = "max_tokens" not in self.model_fields_set
        return self._sampling_params(_COMPLETION_DEFAULT_MAX_TOKENS if omitted else self.max_tokens, self.logprobs,
                                     bool(self.stream), defaults or {}, clamp_max_tokens=omitted,
                                     prompt_logprobs=self._prompt_logprobs())

    def _prompt_logprobs(self) -> int | None:
        """vLLM's rule: echo scores the prompt with `logprobs` alternatives unless prompt_logprobs says otherwise.
        echo with max_tokens 0 returns the prompt alone: it scores with 0 alternatives (the cheapest), since a
        request that generates nothing must at least score its prompt."""
        k = self._user_prompt_logprobs()
        if k is None and self.echo:
            k = self.logprobs
            if k is None and self.max_tokens == 0:
                k = 0
        return k

    @property
    def shows_prompt_logprobs(self) -> bool:
        """Whether choices carry prompt_logprobs: asked for, or echo with logprobs (as vLLM)."""
        return self.prompt_logprobs is not None or (self.echo and self.logprobs is not None)


_COMPLETION_DEFAULT_MAX_TOKENS = 16
# what beam search honours (stream is refused by the route; temperature must be 0 or absent)
_BEAM_SEARCH_FIELDS = frozenset({"model", "prompt", "n", "best_of", "max_tokens", "use_beam_search", "length_penalty",
                                 "echo", "request_id", "add_special_tokens", "user", "stream", "temperature"})


class CompletionLogprobs(BaseModel):
    """The legacy format.  With echo the prompt's tokens come first, scored (the first one null, as OpenAI)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids (in a stream: the choice's first chunk)
    token_ids: list[int] | None = None  # vLLM's return_token_ids
    prompt_logprobs: PromptLogprobsJSON | None = None  # vLLM: per choice for completions


class CompletionStreamChoice(CompletionChoice):
    """A stream chunk's choice: return_token_ids' fields are left out where the chunk carries none (as vLLM)."""

    @model_serializer(mode="wrap")
    def _omit_null_ids(self, handler):
        out = handler(self)
        for key in ("token_ids", "prompt_token_ids"):
            if key in out and out[key] is None:
                del out[key]
        return out


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=unix_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class CompletionStreamResponse(CompletionResponse):
    """A stream chunk (its choices leave out absent ids)."""

    choices: list[CompletionStreamChoice]  # type: ignore[assignment]
