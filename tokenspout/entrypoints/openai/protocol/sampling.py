"""What chat and completion requests share: strict parsing (unknown fields are a 400), vLLM's sampling extras at
the top level, structured-output fields, and the mapping onto SamplingParams."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokenspout.entrypoints.openai.protocol.bounds import FLAGS, RequestBounds, check_sizes, request_bounds
from tokenspout.entrypoints.openai.protocol.common import RequestId
from tokenspout.entrypoints.openai.protocol.errors import OpenAIServingError, value_error_to_serving_error
from tokenspout.entrypoints.openai.structured import structured_outputs_from_request
from tokenspout.reasoning.budget import EFFORT_BUDGETS
from tokenspout.sampling_params import MAX_DRY_BREAKERS, SEED_MAX, SEED_MIN, RequestOutputKind, SamplingParams

MAX_N = 128  # OpenAI's bound on n
# The default bounds on a request's lists and nesting (bounds.py: each a server flag).
_DEFAULTS = RequestBounds()
MAX_JSON_DEPTH = _DEFAULTS.json_depth
MAX_STOP = _DEFAULTS.stop
MAX_TOKEN_LIST = _DEFAULTS.token_list
MAX_ALLOWED_TOKEN_IDS = _DEFAULTS.allowed_token_ids


def _check_text(value: Any, path: str, depth: int = 0) -> None:
    """Strings must be encodable as UTF-8: JSON allows lone UTF-16 surrogates ("\\ud800"), tokenizers do not.
    Objects and lists nest at most request_bounds().json_depth deep (the walk stops there, and later code that
    recurses over a schema or a message can never meet a deeper one).  A fast walk first (no paths, numbers
    skipped: 3M token ids in an 8 MB body took 2-5 s of the event loop with a path built per element); the walk
    that names the faulty element only where it found one."""
    bounds = request_bounds()
    if _clean(value, depth, bounds.json_depth, [bounds.json_containers]):
        return
    _locate_fault(value, path, depth, [bounds.json_containers])


_SCALARS = frozenset({int, float, bool, type(None)})


def _clean(value: Any, depth: int, limit: int, budget: list[int]) -> bool:
    """Whether _locate_fault would find nothing (the same rules, in the same order, without a path); `budget`: the
    objects and lists still allowed (counted down)."""
    if depth > limit:
        return False
    if isinstance(value, str):
        return value.isascii() or _encodable(value)
    if isinstance(value, dict | list):
        budget[0] -= 1
        if budget[0] < 0 or (value and depth + 1 > limit):
            return False
    if isinstance(value, dict):
        return all(_clean(k, depth + 1, limit, budget) and (type(v) in _SCALARS or _clean(v, depth + 1, limit, budget))
                   for k, v in value.items())
    if isinstance(value, list):
        if set(map(type, value)) <= _SCALARS:  # (a list of token ids: its element types collected in C)
            return True
        return all(type(v) in _SCALARS or _clean(v, depth + 1, limit, budget) for v in value)
    return True


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _locate_fault(value: Any, path: str, depth: int, budget: list[int]) -> None:
    """Raises ValueError naming where _clean's rules fail (the first such place)."""
    field = path.split(".", 1)[0] or "body"
    if depth > (limit := request_bounds().json_depth):
        raise ValueError(f"{field}: JSON nested deeper than {limit} levels ({FLAGS['json_depth']})")
    if isinstance(value, dict | list):
        budget[0] -= 1
        if budget[0] < 0:
            raise ValueError(f"{field}: the body holds more than {request_bounds().json_containers} JSON objects "
                             f"and lists ({FLAGS['json_containers']})")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{path or 'body'} holds a lone UTF-16 surrogate, which is not valid Unicode text") \
                from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _locate_fault(k, path, depth + 1, budget)
            _locate_fault(v, f"{path}.{k}" if path else str(k), depth + 1, budget)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _locate_fault(v, f"{path}.{i}", depth + 1, budget)


class StrictModel(BaseModel):
    """Every request object rejects fields it does not know: a silently ignored field is a bug (the client meant
    something by it).  The error names the field (see `validation_error_to_serving_error`)."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(StrictModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: every chunk carries the usage so far


class JsonSchemaFormat(StrictModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(StrictModel):
    """vLLM's `structured_outputs` object: exactly one constraint."""

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _bounded(cls, data: Any) -> Any:
        check_sizes(data, {"choice": "token_list"}, "structured_outputs.")
        return data


# Request fields passed to SamplingParams as they are when set (it validates them; unset: its neutral default).
EXTRA_SAMPLING_FIELDS = (
    "typical_p", "epsilon_cutoff", "eta_cutoff", "top_n_sigma", "xtc_probability", "xtc_threshold", "dynatemp_range",
    "dynatemp_exponent", "no_repeat_ngram_size", "dry_multiplier", "dry_base", "dry_allowed_length",
    "dry_penalty_last_n", "dry_sequence_breakers", "mirostat", "mirostat_tau", "mirostat_eta",
)


class SamplingRequest(StrictModel):
    """Fields shared by chat and completions, including vLLM's extra sampling knobs at the top level."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # OpenAI's end-user id: informational only
    # vLLM extras
    request_id: RequestId | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    # structured output (see structured.py)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # classifier-free guidance
    guidance_scale: float = 1.0

    # Lists bounded by the server's flags (bounds.py): field -> RequestBounds attribute.
    SIZED: ClassVar[dict[str, str]] = {"stop": "stop", "logit_bias": "token_list", "stop_token_ids": "token_list",
                                       "allowed_token_ids": "allowed_token_ids", "bad_words": "token_list",
                                       "guided_choice": "token_list"}
    negative_prompt: str | None = None
    # vLLM extra: logprobs of the prompt tokens (+ top-N), in the response's prompt_logprobs
    prompt_logprobs: int | None = None
    # vLLM's --logprobs-mode, per request here: the model's distribution (raw) or the one the sampler drew from
    # (processed: after bans, bias, penalties, temperature, min-p, top-k/top-p)
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] | None = None
    # Further warpers (SamplingParams has their ranges and semantics; README "Sampling parameters")
    typical_p: float | None = None
    epsilon_cutoff: float | None = None
    eta_cutoff: float | None = None
    top_n_sigma: float | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    dynatemp_range: float | None = None
    dynatemp_exponent: float | None = None
    no_repeat_ngram_size: int | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: list[str] | None = Field(default=None, max_length=MAX_DRY_BREAKERS)
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    # Reasoning budget (chat with --reasoning-parser only; README "Reasoning")
    thinking_token_budget: int | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        check_sizes(data, cls.SIZED)  # (first: a length is cheap, the walk below is not)
        cls._check_prompt_count(data)
        _check_text(data, "")
        return data

    @classmethod
    def _check_prompt_count(cls, data: Any) -> None:
        """Completions: a list of prompts past the server's fan-out, refused before its elements are walked."""
        return

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> Self:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's rule: continuous_usage_stats counts only together with include_usage."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def _logit_bias_ids(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        ids: dict[int, float] = {}
        for key, bias in self.logit_bias.items():
            try:
                ids[int(key)] = bias
            except ValueError:
                raise OpenAIServingError(
                    f"logit_bias keys must be token ids (integers as strings), got {key!r}", param="logit_bias"
                ) from None
        return ids

    def _thinking_budget(self) -> int | None:
        if self.thinking_token_budget is not None and self.reasoning_effort is not None:
            raise OpenAIServingError("reasoning_effort and thinking_token_budget both set a reasoning budget; send one",
                                     param="reasoning_effort")
        if self.reasoning_effort is not None:
            return EFFORT_BUDGETS[self.reasoning_effort]
        return self.thinking_token_budget

    def _user_prompt_logprobs(self) -> int | None:
        """prompt_logprobs as sent; as vLLM, a stream cannot carry them (its chunks have no place for them)."""
        k = self.prompt_logprobs
        if k is not None and self.stream and (k > 0 or k == -1):
            raise OpenAIServingError("prompt_logprobs are not available when stream=true", param="prompt_logprobs")
        return k

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, stream: bool,
                         defaults: Mapping[str, Any], clamp_max_tokens: bool = False,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        """`defaults`: the model's generation_config sampling defaults for fields the request omits."""
        def pick(name: str, neutral: Any) -> Any:
            value = getattr(self, name)
            return defaults.get(name, neutral) if value is None else value

        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        try:
            return SamplingParams(
                n=self.n,
                temperature=pick("temperature", 1.0),
                top_p=pick("top_p", 1.0),
                top_k=pick("top_k", 0),
                min_p=pick("min_p", 0.0),
                seed=self.seed,
                presence_penalty=pick("presence_penalty", 0.0),
                frequency_penalty=pick("frequency_penalty", 0.0),
                repetition_penalty=pick("repetition_penalty", 1.0),
                max_tokens=max_tokens,
                clamp_max_tokens=clamp_max_tokens,
                min_tokens=self.min_tokens,
                stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                logprobs_mode=self.logprobs_mode or "raw_logprobs",
                logit_bias=self._logit_bias_ids(),
                allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words,
                skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                truncate_prompt_tokens=self.truncate_prompt_tokens,
                truncation_side=self.truncation_side or "left",
                output_kind=kind,
                structured_outputs=structured_outputs_from_request(self),
                guidance_scale=self.guidance_scale,
                negative_prompt=self.negative_prompt,
                **{name: getattr(self, name) for name in EXTRA_SAMPLING_FIELDS if getattr(self, name) is not None},
                thinking_token_budget=self._thinking_budget(),
            )
        except ValueError as e:
            raise value_error_to_serving_error(e, set(type(self).model_fields)) from None

    def to_sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """This request's SamplingParams (each route's request says how its fields map)."""
        raise NotImplementedError


def to_sampling_params(request: SamplingRequest,
                       defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """DELTA for streams (each chunk carries only what is new), FINAL_ONLY otherwise (one output at the end).
    `defaults`: sampling defaults of the model's generation_config for the fields the request omits."""
    return request.to_sampling_params(defaults)
