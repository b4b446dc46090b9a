"""/v1/chat/completions: the request (messages, tools, template options) and the response and stream chunk."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from tokenspout.entrypoints.openai.protocol.bounds import RequestBounds
from tokenspout.entrypoints.openai.protocol.common import (
    PromptLogprobsJSON,
    TopLogprob,
    UsageInfo,
    unix_now,
)
from tokenspout.entrypoints.openai.protocol.errors import OpenAIServingError
from tokenspout.entrypoints.openai.protocol.sampling import SamplingRequest, StrictModel
from tokenspout.sampling_params import MAX_LOGPROBS, SamplingParams

_DEFAULTS = RequestBounds()
MAX_MESSAGES = _DEFAULTS.messages  # the defaults (bounds.py: each a server flag)
MAX_TOOLS = _DEFAULTS.tools


class ContentPart(BaseModel):
    """Extra keys are kept (not forbidden) so that an image or audio part is refused by its type, in
    `template_messages`, with a message that says only text parts are supported."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(StrictModel):
    """Keys beyond OpenAI's reach the chat template as they are (as vLLM: templates read e.g. `reasoning_content`
    or `thinking` on an assistant turn); they are still bounded by the body's size and nesting checks."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An agent's history: they reach the chat template whole (templates that know tools render them).
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # OpenAI's fields this server cannot honour stay a 400 rather than reaching the template as extra keys.
    audio: None = None
    function_call: None = None


_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class FunctionDefinition(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")  # OpenAI's rule
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; the constrained calls enforce it
    strict: bool | None = None  # every call is constrained to its schema, strict or not


class ChatTool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
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

    SIZED: ClassVar[dict[str, str]] = {**SamplingRequest.SIZED, "messages": "messages", "tools": "tools"}

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
            for key, value in (msg.model_extra or {}).items():
                entry[key] = value
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


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=unix_now)
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


def _drop_null_ids(out: dict[str, Any]) -> dict[str, Any]:
    """vLLM leaves return_token_ids' fields out of a stream's chunks that do not carry them (never null)."""
    for key in ("token_ids", "prompt_token_ids"):
        if key in out and out[key] is None:
            del out[key]
    return out


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids: this chunk's ids

    @model_serializer(mode="wrap")
    def _omit_null_ids(self, handler):
        return _drop_null_ids(handler(self))


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids: in the first chunk

    @model_serializer(mode="wrap")
    def _omit_null_ids(self, handler):
        return _drop_null_ids(handler(self))
