"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens): request and response models and Anthropic's
error shape `{"type": "error", "error": {"type", "message"}}`.  Requests are strict as on every route here: a field
the translation cannot honour is a 400 naming it."""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Annotated, Any, Literal

import jiter
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from tokenspout.entrypoints.openai.protocol import OpenAIServingError
from tokenspout.entrypoints.openai.protocol.bounds import check_sizes
from tokenspout.entrypoints.openai.protocol.sampling import StrictModel
from tokenspout.entrypoints.openai.protocol.sampling import _check_text as check_text

MAX_BLOCKS = 1024  # content blocks in one message (an agent's turn may hold many tool results)
MAX_ID = 256

ROUTE = "/v1/messages"


def is_anthropic_path(path: str) -> bool:
    """Errors on these paths are answered in Anthropic's shape (its clients parse that one)."""
    return path == ROUTE or path.startswith(ROUTE + "/")


# ------------------------------------------------------------------------------------------------ errors
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
                429: "rate_limit_error", 503: "overloaded_error"}


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: ErrorDetail


def error_response(err: OpenAIServingError) -> ErrorResponse:
    kind = _ERROR_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    message = err.message if err.param is None or err.param in err.message else f"{err.param}: {err.message}"
    return ErrorResponse(error=ErrorDetail(type=kind, message=message))


def error_body(err: OpenAIServingError) -> bytes:
    return error_response(err).model_dump_json().encode()


def error_event(err: OpenAIServingError) -> bytes:
    return b"event: error\ndata: " + error_body(err) + b"\n\n"


def auth_error_body(message: str) -> bytes:
    return error_body(OpenAIServingError(message, status=HTTPStatus.UNAUTHORIZED))


# ------------------------------------------------------------------------------------------------ content blocks
class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # a caching hint: the prefix cache needs none
    citations: None = None


class DirectCaller(StrictModel):
    type: Literal["direct"]  # the model called the tool itself (no code-execution tool is served)


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=MAX_ID)
    name: str = Field(min_length=1, max_length=64)
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    caller: DirectCaller | None = None
    toolset_name: None = None  # MCP toolsets are not served


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=MAX_ID)
    # (the bound on the list alone: on the union pydantic applied it to a string's characters too, refusing any
    # tool result over 1024 characters)
    content: str | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None
    toolset_name: None = None

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or [])
        return f"Error: {body}" if self.is_error else body  # the template has no field for it


class ThinkingBlock(StrictModel):
    """An earlier reply's thinking sent back: accepted and left out of the prompt (templates drop past reasoning)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(StrictModel):
    type: Literal["redacted_thinking"]
    data: str


class _UnsupportedBlock(StrictModel):
    type: Literal["text", "tool_use", "tool_result", "thinking", "redacted_thinking"]


def _block_kind(block: Any) -> str:
    kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
    return kind if kind in ("text", "tool_use", "tool_result", "thinking", "redacted_thinking") else "unsupported"


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")] | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")] | Annotated[_UnsupportedBlock, Tag("unsupported")],
    Discriminator(_block_kind),
]


class InputMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[ContentBlock], Field(max_length=MAX_BLOCKS)]  # (the list's bound: see above)


# ------------------------------------------------------------------------------------------------ tools
class Tool(StrictModel):
    type: Literal["custom"] | None = None  # Anthropic's server tools (web_search, bash, ...) are not served
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_only_for_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice: 'name' is required with type 'tool' and allowed only there")
        return self


class Thinking(StrictModel):
    """`enabled` / `disabled` reach the chat template as `enable_thinking` (Qwen3's switch); the reasoning the model
    writes is split out by --reasoning-parser.  `budget_tokens` is accepted but not enforced (README)."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=1)
    display: Literal["summarized"] | None = None  # the reasoning is returned as written (there is no summary)


class JsonOutputFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class OutputConfig(StrictModel):
    """Structured output: the reply is constrained to the schema (the grammar of the chat route's
    response_format).  `effort` cannot be honoured (how much a model writes is not chosen here)."""

    format: JsonOutputFormat | None = None
    effort: None = None


class Metadata(StrictModel):
    user_id: str | None = Field(default=None, max_length=256)  # informational


class MessagesBase(StrictModel):
    """What /v1/messages and /v1/messages/count_tokens share."""

    model: str
    messages: list[InputMessage]  # --max-request-messages
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None  # --max-request-tools
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None  # a caching hint: the prefix cache needs none

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        check_text(data, "")
        # the bounds of the server parsing the request (bounds.py: each a serve flag, named in the 400)
        check_sizes(data, {"messages": "messages", "tools": "tools", "stop_sequences": "stop"})
        return data

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "\n".join(b.text for b in self.system)


class MessagesRequest(MessagesBase):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None  # --max-request-stop
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)  # Anthropic's range
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here


class CountTokensRequest(MessagesBase):
    pass


# ------------------------------------------------------------------------------------------------ the response
class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # nothing is signed here; clients send it back unchanged


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


OutBlock = TextOut | ThinkingOut | ToolUseOut


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0  # prompt tokens served from the prefix cache
    cache_creation_input_tokens: int = 0


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[OutBlock] = Field(default_factory=list)
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None = None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's JSON arguments as tool_use.input (an object).  Arguments cut short (max_tokens, a stop sequence)
    are read as far as they go, as the anthropic client reads a stream's input_json_delta fragments (jiter's
    partial mode), so a streamed and a non-streamed reply give the same input."""
    try:
        value = json.loads(arguments)
    except ValueError:
        try:
            value = jiter.from_json(arguments.encode(), partial_mode=True)
        except ValueError:
            return {}
    return value if isinstance(value, dict) else {}
