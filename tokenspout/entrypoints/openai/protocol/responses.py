"""/v1/responses (OpenAI's Responses API): the request (input items, tools, text format) and the response object
with its output items.  The request is translated onto a chat request (serving_responses.py); only what that
translation can honour is accepted, every other field is a 400 naming it (as on the chat route)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from tokenspout.entrypoints.openai.protocol.bounds import check_sizes
from tokenspout.entrypoints.openai.protocol.common import RequestId, unix_now
from tokenspout.entrypoints.openai.protocol.sampling import StrictModel
from tokenspout.entrypoints.openai.protocol.sampling import _check_text as check_text
from tokenspout.sampling_params import MAX_LOGPROBS, SEED_MAX, SEED_MIN

MAX_CONTENT_PARTS = 256  # text parts in one input message
MAX_METADATA = 16  # OpenAI's bound on metadata keys
MAX_ID = 256  # ids a client sends back (previous_response_id, call ids)


# ------------------------------------------------------------------------------------------------ input items
class InputTextPart(StrictModel):
    """A text part of an input message.  `output_text` is how an earlier assistant message comes back (with its
    annotations and logprobs, which change nothing here); images, files and audio are refused by their type."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = Field(default=None, max_length=0)
    logprobs: list[Any] | None = None


class InputMessage(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    # (the bound on the list alone: on the union pydantic applied it to a string's characters too, refusing any
    # message over 256 characters)
    content: str | Annotated[list[InputTextPart], Field(max_length=MAX_CONTENT_PARTS)]
    id: str | None = Field(default=None, max_length=MAX_ID)  # set on an earlier response's output item sent back
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallInput(StrictModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=MAX_ID)
    name: str = Field(min_length=1, max_length=64)
    arguments: str
    id: str | None = Field(default=None, max_length=MAX_ID)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputInput(StrictModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=MAX_ID)
    output: str | Annotated[list[InputTextPart], Field(max_length=MAX_CONTENT_PARTS)]  # (the list's bound, as above)
    id: str | None = Field(default=None, max_length=MAX_ID)
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningTextPart(StrictModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningInput(StrictModel):
    """An earlier reply's reasoning sent back (agents do): accepted and left out of the prompt, as chat templates
    drop past reasoning."""

    type: Literal["reasoning"]
    id: str | None = Field(default=None, max_length=MAX_ID)
    summary: list[ReasoningTextPart] = Field(default_factory=list, max_length=MAX_CONTENT_PARTS)
    content: list[ReasoningTextPart] | None = Field(default=None, max_length=MAX_CONTENT_PARTS)
    encrypted_content: None = None  # never produced here, so never valid to send back
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_kind(item: Any) -> str:
    """Items without a `type` are messages (OpenAI's EasyInputMessage)."""
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")
    return kind if kind in ("message", "function_call", "function_call_output", "reasoning") else "unsupported"


class _UnsupportedItem(StrictModel):
    type: Literal["message", "function_call", "function_call_output", "reasoning"]


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallInput, Tag("function_call")]
    | Annotated[FunctionCallOutputInput, Tag("function_call_output")] | Annotated[ReasoningInput, Tag("reasoning")]
    | Annotated[_UnsupportedItem, Tag("unsupported")],
    Discriminator(_item_kind),
]


# ------------------------------------------------------------------------------------------------ tools, formats
class FunctionTool(StrictModel):
    type: Literal["function"]  # built-in tools (web_search, file_search, ...) are not served
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # every call is constrained to its schema, strict or not


class NamedFunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _schema_only_for_json_schema(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("text.format: type 'json_schema' needs a 'schema'")
        if self.type != "json_schema" and (self.schema_ is not None or self.name is not None):
            raise ValueError(f"text.format: 'name' and 'schema' belong to type 'json_schema', not {self.type!r}")
        return self


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only value that changes nothing


class ReasoningConfig(StrictModel):
    """The reasoning the model writes is split out by --reasoning-parser; how much it writes cannot be chosen."""

    effort: None = None
    summary: None = None
    generate_summary: None = None


# ------------------------------------------------------------------------------------------------ the request
class ResponsesRequest(StrictModel):
    model: str | None = None
    input: str | list[InputItem]  # items bounded as chat messages (--max-request-messages)
    instructions: str | None = None
    tools: list[FunctionTool] | None = None  # --max-request-tools
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    store: bool = True
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID)
    stream: bool = False
    metadata: dict[str, str] | None = Field(default=None, max_length=MAX_METADATA)
    user: str | None = None  # informational
    # OpenAI fields accepted only with the value that changes nothing here
    truncation: Literal["disabled"] | None = None
    # the one extra output served: the message text's token logprobs (with top_logprobs alternatives)
    include: list[Literal["message.output_text.logprobs"]] | None = Field(default=None, max_length=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    service_tier: Literal["auto", "default"] | None = None
    background: Literal[False] | None = None
    # vLLM extras (as on the chat route)
    request_id: RequestId | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        check_text(data, "")
        # the bounds of the server parsing the request (bounds.py: each a serve flag, named in the 400)
        check_sizes(data, {"input": "messages", "tools": "tools"})
        return data

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.include)


# ------------------------------------------------------------------------------------------------ the response
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class MessageItem(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = MessageItem | FunctionCallItem | ReasoningItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    cache_write_tokens: int = 0  # OpenAI's field (required by its client's types); no cache is billed here


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=unix_now)
    status: Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"] = "completed"
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
