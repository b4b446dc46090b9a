"""OpenAI API request / response models, the error shape, and the request → SamplingParams mapping.

Unknown request fields are rejected with a 400 naming them (a field the server silently ignored would change what
the client meant); README "Coming from vLLM" lists what is supported.  Range checks live in SamplingParams (one source of
truth); only what SamplingParams cannot know (OpenAI's top_logprobs / logprobs bounds, message shapes) is checked here.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from tokenspout.entrypoints.openai.structured import structured_outputs_from_request
from tokenspout.sampling_params import MAX_LOGPROBS, SEED_MAX, SEED_MIN, RequestOutputKind, SamplingParams

# ---------------------------------------------------------------------------------------------------- errors

_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    415: "UnsupportedMediaTypeError",
    499: "ClientClosedRequest",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class OpenAIServingError(Exception):
    """An error the server answers in OpenAI's shape; raised anywhere in the serving path."""

    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.param = param

    def to_response(self) -> ErrorResponse:
        err_type = _ERROR_TYPES.get(self.status, "BadRequestError" if self.status < 500 else "InternalServerError")
        return ErrorResponse(error=ErrorInfo(message=self.message, type=err_type, param=self.param, code=self.status))


def _field_path(loc: tuple) -> str:
    # Drop pydantic's union-member tags ("list[int]", "str", "function-after[...]") so the path names the field.
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS)))


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
_FIELD_PATH = re.compile(r"^[A-Za-z_][\w.]*$")


def validation_error_to_serving_error(exc: ValidationError | Sequence[Mapping[str, Any]]) -> OpenAIServingError:
    """Maps pydantic's errors (a ValidationError, or FastAPI's `errors()` list whose paths start with "body") to one
    400 that names the offending field (dotted path, e.g. messages.0.content)."""
    errors = exc.errors() if isinstance(exc, ValidationError) else exc
    by_field: dict[str, str] = {}
    for err in errors:
        loc = tuple(err.get("loc", ()))
        path = _field_path(loc[1:] if loc[:1] == ("body",) else loc)
        if path in by_field:  # a union reports once per member type; the first says enough
            continue
        kind = err.get("type")
        if kind == "extra_forbidden":
            by_field[path] = "unsupported field: tokenspout does not implement it (see the README, Coming from vLLM)"
        elif kind == "json_invalid":
            by_field[""] = f"request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}"
        else:
            value = err.get("input")
            got = f" (got {value!r})" if "input" in err and not isinstance(value, dict | list) else ""
            msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
            if not path:  # a model-level check: its message starts with the field it is about
                head = msg.split(":", 1)[0].split(" ", 1)[0]
                if _FIELD_PATH.match(head):
                    path, msg, got = head, msg.removeprefix(head + ":").strip(), ""
            by_field[path] = f"{msg}{got}"
        if len(by_field) == 3:
            break
    message = "; ".join(
        f"{path}: {msg}" if path and not msg.startswith(path.split(".")[0]) else msg for path, msg in by_field.items()
    )
    return OpenAIServingError(message or "invalid request", param=next(iter(by_field), None) or None)


def value_error_to_serving_error(exc: ValueError, fields: set[str]) -> OpenAIServingError:
    """SamplingParams / engine messages start with the field name ("top_p must be in (0, 1], got 2.0"), or with it
    and a colon ("tools: ...")."""
    msg = str(exc)
    head = msg.split(" ", 1)[0].removesuffix(":") if msg else ""
    return OpenAIServingError(msg or "invalid request", param=head if head in fields else None)


# ---------------------------------------------------------------------------------------------------- requests

MAX_N = 128  # OpenAI's bound on n


def _check_text(value: Any, path: str) -> None:
    """Strings must be encodable as UTF-8: JSON allows lone UTF-16 surrogates ("\\ud800"), tokenizers do not."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{path or 'body'} holds a lone UTF-16 surrogate, which is not valid Unicode text") \
                from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k, path)
            _check_text(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_text(v, f"{path}.{i}")


class _Strict(BaseModel):
    """Every request object rejects fields it does not know: a silently ignored field is a bug (the client meant
    something by it).  The error names the field (see `validation_error_to_serving_error`)."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: every chunk carries the usage so far


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs` object: exactly one constraint."""

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _SamplingRequest(_Strict):
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
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
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
    negative_prompt: str | None = None
    # vLLM extra: logprobs of the prompt tokens (+ top-N), in the response's prompt_logprobs
    prompt_logprobs: int | None = None
    # vLLM's --logprobs-mode, per request here: the model's distribution (raw) or the one the sampler drew from
    # (processed: after bans, bias, penalties, temperature, min-p, top-k/top-p)
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        _check_text(data, "")
        return data

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
            )
        except ValueError as e:
            raise value_error_to_serving_error(e, set(type(self).model_fields)) from None


class ContentPart(BaseModel):
    """Extra keys are kept (not forbidden) so that an image or audio part is refused by its type, in
    `template_messages`, with a message that says only text parts are supported."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An agent's history: they reach the chat template whole (templates that know tools render them).
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")  # OpenAI's rule
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; the constrained calls enforce it
    strict: bool | None = None  # every call is constrained to its schema, strict or not


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # OpenAI fields that change nothing here: accepted only with the values that mean exactly that.
    store: Literal[False] | None = None  # nothing is stored
    metadata: dict[str, str] | None = None  # informational (OpenAI keeps it with stored completions)
    service_tier: Literal["auto", "default"] | None = None
    modalities: list[Literal["text"]] | None = None
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # vLLM extra: add the tokenizer's BOS on top of what the template wrote
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False  # the reply starts with the last message's content when it has the reply's role
    # tool calling (see engine/chat_tools.py)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]

    def tool_choice_value(self) -> str | dict[str, Any] | None:
        tc = self.tool_choice
        return tc.model_dump() if isinstance(tc, NamedToolChoice) else tc

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as the chat template wants them: content flattened to a string."""
        if not self.messages:
            raise OpenAIServingError("messages must be a non-empty list", param="messages")
        out = []
        for i, msg in enumerate(self.messages):
            if msg.role not in _CHAT_ROLES:
                raise OpenAIServingError(
                    f"messages.{i}.role must be one of {', '.join(_CHAT_ROLES)}, got {msg.role!r}",
                    param=f"messages.{i}.role",
                )
            if isinstance(msg.content, list):
                texts = []
                for j, part in enumerate(msg.content):
                    if part.type != "text" or part.text is None or part.model_extra:
                        raise OpenAIServingError(
                            f"messages.{i}.content.{j}: only parts of type 'text' with a 'text' field (and no other "
                            f"key) are supported, got type {part.type!r}",
                            param=f"messages.{i}.content.{j}",
                        )
                    texts.append(part.text)
                content = "\n".join(texts)
            else:
                content = msg.content or ""
            # Templates know "system" but rarely OpenAI's newer "developer" role, which means the same thing.
            entry = {"role": "system" if msg.role == "developer" else msg.role, "content": content}
            for key in ("name", "tool_calls", "tool_call_id"):
                if getattr(msg, key) is not None:
                    entry[key] = getattr(msg, key)
            out.append(entry)
        return out

    def to_sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise OpenAIServingError("top_logprobs requires logprobs to be true", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        use_completion = self.max_completion_tokens is not None
        try:
            return self._sampling_params(
                self.max_completion_tokens if use_completion else self.max_tokens, logprobs, bool(self.stream),
                defaults or {}, prompt_logprobs=self._user_prompt_logprobs(),
            )
        except OpenAIServingError as e:
            if use_completion and e.param == "max_tokens":  # name the field the client actually sent
                e.param, e.message = "max_completion_tokens", e.message.replace("max_tokens", "max_completion_tokens")
                e.args = (e.message,)
            raise


class CompletionRequest(_SamplingRequest):
    prompt: list[int] | list[list[int]] | list[str] | str
    max_tokens: int | None = None  # omitted: OpenAI's legacy default, 16 (see to_sampling_params)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    use_beam_search: bool = False  # n = beam width
    add_special_tokens: bool = True  # vLLM extra: the tokenizer's special tokens (BOS) around a text prompt
    length_penalty: float = 1.0

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        def is_ids(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(v, str) or (isinstance(v, list) and (is_ids(v) or all(isinstance(x, str) for x in v)
                                                           or all(is_ids(x) for x in v))):
            return v
        raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of such lists")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            prompts: list[str | list[int]] = [p]
        elif p and all(isinstance(t, int) for t in p):
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


def to_sampling_params(request: ChatCompletionRequest | CompletionRequest,
                       defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """DELTA for streams (each chunk carries only what is new), FINAL_ONLY otherwise (one output at the end).
    `defaults`: sampling defaults of the model's generation_config for the fields the request omits."""
    return request.to_sampling_params(defaults)


# ---------------------------------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    # With --reasoning-parser: the reasoning, under both names vLLM has used (absent otherwise).
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_serializer(mode="wrap")
    def _drop_absent_reasoning(self, handler):
        out = handler(self)
        for key in ("reasoning_content", "reasoning"):
            if out.get(key) is None:
                out.pop(key, None)
        return out


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids


def _now() -> int:
    return int(time.time())


class PromptLogprob(BaseModel):
    """vLLM's Logprob of one token at one prompt position (rank 1 = most likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per prompt token (the first null): token id (as a string) -> its logprob.
PromptLogprobsJSON = list[dict[str, PromptLogprob] | None]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids
    prompt_logprobs: PromptLogprobsJSON | None = None  # vLLM: top level for chat


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's delta shape (index, id, type, function)

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):  # OpenAI's deltas carry only the keys that changed
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids: this chunk's ids


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids: in the first chunk


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


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "tokenspout"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
