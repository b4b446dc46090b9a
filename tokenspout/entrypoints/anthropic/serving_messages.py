"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) as a translation onto the chat path:
`system` → a system message, text blocks → content, `tool_use` blocks → the assistant's tool_calls, `tool_result`
blocks → `tool` messages (before the user's text, where Anthropic puts them), tools / tool_choice → OpenAI's,
`stop_sequences` → stop; `OpenAIServingChat.prepare` renders and constrains it as a chat request, and the reply
(split by the same tool and reasoning parsers) becomes `thinking`, `text` and `tool_use` blocks.

Stream: `message_start`, `ping`, per block `content_block_start`, `content_block_delta` (`thinking_delta`,
`text_delta`, `input_json_delta`), `content_block_stop`; then `message_delta` (stop_reason, output usage) and
`message_stop`.  Errors after the first event are an `error` event.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from tokenspout.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    CountTokensResponse,
    MessagesBase,
    MessagesRequest,
    MessagesResponse,
    OutBlock,
    TextBlock,
    TextOut,
    ThinkingOut,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseOut,
    Usage,
    error_event,
    tool_input,
)
from tokenspout.entrypoints.openai.chat_deltas import ChatDelta, chat_deltas
from tokenspout.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    OpenAIServingError,
    UsageInfo,
    validation_error_to_serving_error,
)
from tokenspout.entrypoints.openai.serving_chat import ChatJob, OpenAIServingChat
from tokenspout.entrypoints.openai.serving_common import PromptState, to_serving_error, usage_of

logger = logging.getLogger(__name__)

_RENAMES = {"stop": "stop_sequences", "prompt": "messages", "response_format": "output_config.format"}


def _renamed(err: OpenAIServingError) -> OpenAIServingError:
    if err.param is not None:
        head, dot, rest = err.param.partition(".")
        err.param = _RENAMES.get(head, head) + dot + rest
    return err


def chat_messages(req: MessagesBase) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = req.system_text()
    if system:
        out.append({"role": "system", "content": system})
    for msg in req.messages:
        if isinstance(msg.content, str):
            out.append({"role": msg.role, "content": msg.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for block in msg.content:
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolUseBlock) and msg.role == "assistant":
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input)}})
            elif isinstance(block, ToolResultBlock) and msg.role == "user":
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
            elif isinstance(block, ToolUseBlock | ToolResultBlock):
                raise OpenAIServingError(f"messages: a {block.type} block belongs to "
                                         f"{'an assistant' if block.type == 'tool_use' else 'a user'} message",
                                         param="messages")
            # thinking / redacted_thinking: left out, as chat templates drop past reasoning
        if texts or calls or not any(isinstance(b, ToolResultBlock) for b in msg.content):
            entry: dict[str, Any] = {"role": msg.role, "content": "".join(texts) if texts or not calls else None}
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
    return out


def chat_body(req: MessagesBase) -> dict[str, Any]:
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req)}
    if req.tools is not None:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": t.input_schema,
            **({"description": t.description} if t.description is not None else {})}} for t in req.tools]
    tc = req.tool_choice
    if tc is not None:
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(tc.type) or \
            {"type": "function", "function": {"name": tc.name}}
        if tc.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stream=req.stream)
        if req.stop_sequences:
            body["stop"] = req.stop_sequences
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
    return body


def _usage(usage: UsageInfo) -> Usage:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return Usage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                 cache_read_input_tokens=cached)


def _stop_reason(req: MessagesRequest, finish_reason: str | None, stop_reason: int | str | None
                 ) -> tuple[str, str | None]:
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str) and stop_reason in (req.stop_sequences or ()):
        return "stop_sequence", stop_reason
    return "end_turn", None


@dataclass(slots=True)
class MessagesJob:
    request: MessagesRequest
    chat: ChatJob

    @property
    def message_id(self) -> str:
        return "msg_" + self.chat.request_id.removeprefix("chatcmpl-")


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    @staticmethod
    def end_frame(err: OpenAIServingError) -> bytes:
        """Ends a stream the server cut (its shutdown deadline): Anthropic's error event."""
        return error_event(err)

    def _prepare_chat(self, req: MessagesBase) -> ChatJob:
        try:
            chat_req = ChatCompletionRequest.model_validate(chat_body(req))
        except ValidationError as e:
            raise _renamed(validation_error_to_serving_error(e)) from None
        try:
            return self.chat.prepare(chat_req)
        except OpenAIServingError as e:
            raise _renamed(e) from None

    def prepare(self, req: MessagesRequest) -> MessagesJob:
        """Runs off the event loop (as the chat route's prepare, which it calls)."""
        return MessagesJob(req, self._prepare_chat(req))

    def count_tokens(self, req: CountTokensRequest) -> CountTokensResponse:
        """The prompt's tokens exactly as /v1/messages renders and encodes it (runs off the event loop)."""
        job = self._prepare_chat(req)
        ids = self.chat.engine.tokenizer.encode(job.prompt, add_special_tokens=False)
        return CountTokensResponse(input_tokens=len(ids))

    # ------------------------------------------------------------------------------------------ non-streaming
    async def complete(self, job: MessagesJob) -> MessagesResponse:
        try:
            chat = await self.chat.complete(job.chat)
        except OpenAIServingError as e:
            raise _renamed(e) from None
        choice, message = chat.choices[0], chat.choices[0].message
        blocks: list[OutBlock] = []
        if message.reasoning:
            blocks.append(ThinkingOut(thinking=message.reasoning))
        if message.content:
            blocks.append(TextOut(text=message.content))
        blocks += [ToolUseOut(id=c.id, name=c.function.name, input=tool_input(c.function.arguments))
                   for c in message.tool_calls]
        stop_reason, stop_sequence = _stop_reason(job.request, choice.finish_reason, choice.stop_reason)
        return MessagesResponse(id=job.message_id, model=self.chat.engine.model_name, content=blocks,
                                stop_reason=stop_reason, stop_sequence=stop_sequence,  # type: ignore[arg-type]
                                usage=_usage(chat.usage))

    # ------------------------------------------------------------------------------------------ streaming
    async def stream(self, job: MessagesJob) -> AsyncIterator[bytes]:
        state = PromptState(1, job.chat.params.output_kind, self.chat.metrics, keep_text=False)
        deltas = chat_deltas(self.chat.engine, job.chat, state)
        started = False
        try:
            try:
                first = await anext(deltas, None)
            except Exception as e:
                err = state.failed(e)  # a 4xx: rejected input, the request never ran
                raise _renamed(err) from e
            started = True
            events = _EventWriter()
            start = MessagesResponse(id=job.message_id, model=self.chat.engine.model_name,
                                     usage=Usage(input_tokens=state.prompt_tokens, output_tokens=0,
                                                 cache_read_input_tokens=state.num_cached_tokens))
            yield events.emit("message_start", message=start)
            yield events.emit("ping")
            finish_reason: str | None = None
            stop: int | str | None = None
            delta: ChatDelta | None = first
            while delta is not None:
                for frame in events.delta(delta):
                    yield frame
                if delta.finish_reason is not None:
                    finish_reason, stop = delta.finish_reason, delta.stop_reason
                delta = await anext(deltas, None)
            if events.open is not None:
                yield events.close()
            stop_reason, stop_sequence = _stop_reason(job.request, finish_reason, stop)
            usage = usage_of([state])
            yield events.emit("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                              usage={"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens})
            yield events.emit("message_stop")
        except Exception as e:
            if not started:
                raise
            state.finish("error")
            yield error_event(to_serving_error(e))
        finally:
            await deltas.aclose()  # type: ignore[attr-defined]
            state.finish("abort")  # no-op unless the client went away mid-stream


@dataclass(slots=True)
class _EventWriter:
    index: int = -1  # the open block's index
    open: str | None = None  # "thinking" | "text" | "tool_use"
    calls: dict[int, int] = field(default_factory=dict)  # the parser's call index → block index

    @staticmethod
    def emit(kind: str, **data: Any) -> bytes:
        payload = {"type": kind,
                   **{k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in data.items()}}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

    def close(self) -> bytes:
        self.open = None
        return self.emit("content_block_stop", index=self.index)

    def _start(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        frames = [self.close()] if self.open is not None else []
        self.index += 1
        self.open = kind
        frames.append(self.emit("content_block_start", index=self.index, content_block=block))
        return frames

    def delta(self, d: ChatDelta) -> list[bytes]:
        frames: list[bytes] = []
        if d.parts.reasoning:
            if self.open != "thinking":
                frames += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            frames.append(self.emit("content_block_delta", index=self.index,
                                    delta={"type": "thinking_delta", "thinking": d.parts.reasoning}))
        if d.parts.content:
            if self.open != "text":
                frames += self._start("text", {"type": "text", "text": ""})
            frames.append(self.emit("content_block_delta", index=self.index,
                                    delta={"type": "text_delta", "text": d.parts.content}))
        for call in d.parts.tool_calls:
            fn = call.get("function", {})
            if "id" in call:
                frames += self._start("tool_use", {"type": "tool_use", "id": call["id"], "name": fn["name"],
                                                   "input": {}})
                self.calls[call["index"]] = self.index
            fragment = fn.get("arguments") or ""
            # A block's deltas must come before its stop: a fragment of an already closed call (possible only
            # without a grammar) is dropped from the stream.
            if fragment and self.calls.get(call["index"]) == self.index and self.open == "tool_use":
                frames.append(self.emit("content_block_delta", index=self.index,
                                        delta={"type": "input_json_delta", "partial_json": fragment}))
        return frames
