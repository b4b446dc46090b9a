"""POST /v1/responses (OpenAI's Responses API) as a translation onto the chat path: the request becomes a
ChatCompletionRequest (input items → messages, `instructions` → a system message, tools, `text.format` →
response_format), `OpenAIServingChat.prepare` renders and constrains it exactly as a chat request, and the reply
(split by the same tool and reasoning parsers) becomes output items: `reasoning`, `message`, `function_call`.

Stream: `response.created`, `response.in_progress`, then per output item `response.output_item.added`, its deltas
(`response.reasoning_text.delta`, `response.content_part.added` + `response.output_text.delta`,
`response.function_call_arguments.delta`), their `.done` events and `response.output_item.done`; last
`response.completed` (or `response.incomplete` when max_output_tokens cut the reply) with the usage.  Every event
carries `sequence_number`; there is no `[DONE]` (OpenAI sends none on this route).
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from pydantic import BaseModel, ValidationError

from tokenspout.entrypoints.openai.chat_deltas import ChatDelta, chat_deltas
from tokenspout.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatResponseMessage,
    OpenAIServingError,
    UsageInfo,
    validation_error_to_serving_error,
)
from tokenspout.entrypoints.openai.protocol.responses import (
    FunctionCallInput,
    FunctionCallItem,
    FunctionCallOutputInput,
    IncompleteDetails,
    InputMessage,
    InputTokensDetails,
    MessageItem,
    OutputItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from tokenspout.entrypoints.openai.responses_store import ResponseStore
from tokenspout.entrypoints.openai.serving_chat import ChatJob, OpenAIServingChat
from tokenspout.entrypoints.openai.serving_common import PromptState, to_serving_error, usage_of

logger = logging.getLogger(__name__)

# Chat field names in errors → the Responses field the client sent.
_RENAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "seed", "user", "request_id")


def response_id(engine_id: str) -> str:
    """A stored response's id (what GET / DELETE /v1/responses/{id} and previous_response_id name): from the
    engine's id, which is unique even where the client chose the request id (a random suffix then), with anything
    but letters, digits, '-', '_' and '.' replaced (a client's '/' or '?' would make the id's URL name another)."""
    return "resp_" + re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id.removeprefix("chatcmpl-"))


def _renamed(err: OpenAIServingError) -> OpenAIServingError:
    message = err.message
    for chat_name, name in _RENAMES.items():
        message = message.replace(chat_name, name)
    param = err.param
    if param is not None:
        head, dot, rest = param.partition(".")
        param = "input" if head == "prompt" else _RENAMES.get(head, head) + dot + rest  # the rendered prompt
    return OpenAIServingError(message, status=err.status, param=param)


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as chat messages: function_call items join the assistant message before them (as one
    chat message carries a turn's calls), function_call_output items become `tool` messages, reasoning items are
    left out."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict[str, Any]] = []
    for item in req.input:
        if isinstance(item, InputMessage):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallInput):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputInput):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out


def _assistant_message(output: list[OutputItem]) -> dict[str, Any] | None:
    """A reply's output items as the assistant message a follow-up's history holds."""
    text = "".join(p.text for item in output if isinstance(item, MessageItem) for p in item.content)
    calls = [{"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
             for item in output if isinstance(item, FunctionCallItem)]
    if not text and not calls:
        return None
    msg: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def chat_body(req: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request that serves `req` (fields it leaves unset stay unset, so the chat route's defaults hold)."""
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    for name in _SAMPLING_FIELDS:
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.tools is not None:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in req.tools]
    if req.tool_choice is not None:
        tc = req.tool_choice
        body["tool_choice"] = tc if isinstance(tc, str) else {"type": "function", "function": {"name": tc.name}}
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    if req.wants_logprobs:
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    elif req.top_logprobs:
        raise OpenAIServingError("top_logprobs: needs include ['message.output_text.logprobs']",
                                 param="top_logprobs")
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": fmt.model_dump(
            by_alias=True, exclude_none=True, exclude={"type"})}
    return body


def _usage(usage: UsageInfo) -> ResponseUsage:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return ResponseUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                         total_tokens=usage.total_tokens, input_tokens_details=InputTokensDetails(cached_tokens=cached))


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(slots=True)
class ResponsesJob:
    request: ResponsesRequest
    chat: ChatJob
    response_id: str
    history: list[dict[str, Any]]  # the conversation before the reply, without the instructions

    def skeleton(self, model: str) -> ResponseObject:
        """The response object before any output (what response.created carries)."""
        req = self.request
        tc = req.tool_choice
        return ResponseObject(
            id=self.response_id, created_at=self.chat.created, status="in_progress", model=model,
            instructions=req.instructions, metadata=req.metadata,
            parallel_tool_calls=req.parallel_tool_calls is not False, temperature=req.temperature, top_p=req.top_p,
            tool_choice=(tc if isinstance(tc, str) else tc.model_dump()) if tc is not None else "auto",
            tools=[t.model_dump(exclude_none=True) for t in req.tools or []], max_output_tokens=req.max_output_tokens,
            previous_response_id=req.previous_response_id, store=req.store, user=req.user,
            text={"format": req.text.format.model_dump(by_alias=True, exclude_none=True)}
            if req.text is not None and req.text.format is not None else {"format": {"type": "text"}},
        )


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    @staticmethod
    def end_frame(err: OpenAIServingError) -> bytes:
        """Ends a stream the server cut (its shutdown deadline): an `error` event (its place in the sequence is
        not known there)."""
        payload = {"type": "error", "code": str(err.status), "message": err.message, "param": err.param}
        return f"event: error\ndata: {json.dumps(payload)}\n\n".encode()

    @property
    def model_name(self) -> str:
        return self.chat.engine.model_name

    def prepare(self, req: ResponsesRequest) -> ResponsesJob:
        """Runs off the event loop (like the chat route's prepare, which it calls)."""
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            entry = self.store.get(req.previous_response_id)
            if entry is None:
                raise OpenAIServingError(f"Previous response with id '{req.previous_response_id}' not found (it was "
                                         f"never stored, was deleted, or was evicted from this server's store).",
                                         status=HTTPStatus.NOT_FOUND, param="previous_response_id")
            history = list(entry.messages)
        history += input_messages(req)
        messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
        try:
            chat_req = ChatCompletionRequest.model_validate(chat_body(req, messages))
        except ValidationError as e:
            raise _renamed(validation_error_to_serving_error(e)) from None
        try:
            job = self.chat.prepare(chat_req)
        except OpenAIServingError as e:
            raise _renamed(e) from None
        if job.params.n != 1:
            raise OpenAIServingError("n: the Responses API has one output", param="n")
        if req.wants_logprobs and job.plan is not None:
            # The tokens would have to be split between reasoning, text and calls: served for plain text only.
            raise OpenAIServingError("include: message.output_text.logprobs is served for replies without tools "
                                     "or a reasoning parser", param="include")
        return ResponsesJob(req, job, response_id(job.engine_id), history)

    def _store(self, job: ResponsesJob, response: ResponseObject) -> None:
        if not job.request.store:
            return
        reply = _assistant_message(response.output)
        messages = job.history + ([reply] if reply is not None else [])
        if not self.store.put(response.id, response.model_dump_json(), messages):
            logger.warning("response %s is larger than the response store and was not stored", response.id)

    # ------------------------------------------------------------------------------------------ non-streaming
    async def complete(self, job: ResponsesJob) -> ResponseObject:
        try:
            chat = await self.chat.complete(job.chat)
        except OpenAIServingError as e:
            raise _renamed(e) from None
        choice = chat.choices[0]
        response = job.skeleton(self.model_name)
        response.output = self._output_items(choice.message)
        if choice.logprobs is not None and choice.logprobs.content is not None:
            for item in response.output:
                if isinstance(item, MessageItem):
                    item.content[0].logprobs = [lp.model_dump() for lp in choice.logprobs.content]
        response.usage = _usage(chat.usage)
        self._finish(response, choice.finish_reason)
        self._store(job, response)
        return response

    @staticmethod
    def _output_items(message: ChatResponseMessage) -> list[OutputItem]:
        items: list[OutputItem] = []
        if message.reasoning:
            items.append(ReasoningItem(id=_item_id("rs"), content=[ReasoningText(text=message.reasoning)]))
        if message.content:
            items.append(MessageItem(id=_item_id("msg"), content=[OutputText(text=message.content)]))
        for call in message.tool_calls:
            items.append(FunctionCallItem(id=_item_id("fc"), call_id=call.id, name=call.function.name,
                                          arguments=call.function.arguments))
        return items

    @staticmethod
    def _finish(response: ResponseObject, finish_reason: str | None) -> None:
        if finish_reason == "length":
            response.status = "incomplete"
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
            if response.output:  # the item the cut went through
                response.output[-1].status = "incomplete"
        else:
            response.status = "completed"

    # ------------------------------------------------------------------------------------------ streaming
    async def stream(self, job: ResponsesJob) -> AsyncIterator[bytes]:
        """SSE events.  An error before the first output is raised (→ a JSON error with its status); a later one
        is an `error` event, and the stream ends."""
        state = PromptState(1, job.chat.params.output_kind, self.chat.metrics, keep_text=False)
        deltas = chat_deltas(self.chat.engine, job.chat, state)
        started = False
        try:
            try:
                first = await anext(deltas, None)
            except Exception as e:
                err = state.failed(e)  # a 4xx: rejected input, the request never ran
                raise _renamed(err) from e
            top_n = job.chat.params.logprobs
            events = _EventWriter(job.skeleton(self.model_name), logprobs=None if top_n is None else (
                lambda positions: [lp.model_dump() for lp in self.chat.token_logprobs(positions, top_n)]))
            started = True
            yield events.emit("response.created", response=events.response)
            yield events.emit("response.in_progress", response=events.response)
            finish_reason: str | None = None
            delta: ChatDelta | None = first
            while delta is not None:
                for frame in events.delta(delta):
                    yield frame
                finish_reason = delta.finish_reason or finish_reason
                delta = await anext(deltas, None)
            for frame in events.close_all(cut=finish_reason == "length"):
                yield frame
            response = events.response
            response.usage = _usage(usage_of([state]))
            self._finish(response, finish_reason)
            self._store(job, response)
            kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
            yield events.emit(kind, response=response)
        except Exception as e:
            if not started:
                raise
            err = to_serving_error(e)
            state.finish("error")
            yield events.emit("error", code=str(err.status), message=err.message, param=err.param)
        finally:
            await deltas.aclose()  # type: ignore[attr-defined]
            state.finish("abort")  # no-op unless the client went away mid-stream

    # ------------------------------------------------------------------------------------------ stored responses
    def retrieve(self, response_id: str) -> str:
        entry = self.store.get(response_id)
        if entry is None:
            raise OpenAIServingError(f"Response with id '{response_id}' not found.", status=HTTPStatus.NOT_FOUND,
                                     param="response_id")
        return entry.response_json

    def delete(self, response_id: str) -> ResponseDeleted:
        if not self.store.delete(response_id):
            raise OpenAIServingError(f"Response with id '{response_id}' not found.", status=HTTPStatus.NOT_FOUND,
                                     param="response_id")
        return ResponseDeleted(id=response_id)


@dataclass(slots=True)
class _Open:
    """The output item being written (reasoning or message); function calls stay open until the reply ends."""

    index: int
    kind: str  # "reasoning" | "message"
    text: str = ""
    logprobs: list[Any] = field(default_factory=list)


@dataclass(slots=True)
class _EventWriter:
    response: ResponseObject
    seq: int = 0
    open: _Open | None = None
    calls: dict[int, int] = field(default_factory=dict)  # the parser's call index → output index
    logprobs: Any = None  # positions → the output_text logprob entries (when the request included them)

    def emit(self, kind: str, **data: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq,
                   **{k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in data.items()}}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

    def _add(self, item: OutputItem) -> tuple[int, bytes]:
        index = len(self.response.output)
        self.response.output.append(item)
        return index, self.emit("response.output_item.added", output_index=index, item=item)

    def _text_item(self, kind: str) -> list[bytes]:
        """Opens a reasoning or message item unless one of that kind is open (closing any other first)."""
        if self.open is not None and self.open.kind == kind:
            return []
        frames = self.close_text()
        item: OutputItem
        if kind == "reasoning":
            item = ReasoningItem(id=_item_id("rs"), status="in_progress")
            index, frame = self._add(item)
            frames.append(frame)
        else:
            item = MessageItem(id=_item_id("msg"), status="in_progress")
            index, frame = self._add(item)
            frames += [frame, self.emit("response.content_part.added", item_id=item.id, output_index=index,
                                        content_index=0, part=OutputText(text=""))]
        self.open = _Open(index, kind)
        return frames

    def close_text(self, cut: bool = False) -> list[bytes]:
        """Closes the open reasoning / message item: "completed", or with `cut` (max_output_tokens ended the reply
        inside it) "incomplete", as response.incomplete then says of it."""
        op, self.open = self.open, None
        if op is None:
            return []
        item = self.response.output[op.index]
        item.status = "incomplete" if cut else "completed"
        if isinstance(item, ReasoningItem):
            item.content = [ReasoningText(text=op.text)]
            return [self.emit("response.reasoning_text.done", item_id=item.id, output_index=op.index,
                              content_index=0, text=op.text),
                    self.emit("response.output_item.done", output_index=op.index, item=item)]
        assert isinstance(item, MessageItem)
        part = OutputText(text=op.text, logprobs=op.logprobs)
        item.content = [part]
        return [self.emit("response.output_text.done", item_id=item.id, output_index=op.index, content_index=0,
                          text=op.text, logprobs=op.logprobs),
                self.emit("response.content_part.done", item_id=item.id, output_index=op.index, content_index=0,
                          part=part),
                self.emit("response.output_item.done", output_index=op.index, item=item)]

    def delta(self, d: ChatDelta) -> list[bytes]:
        frames: list[bytes] = []
        if d.parts.reasoning:
            frames += self._text_item("reasoning")
            assert self.open is not None
            self.open.text += d.parts.reasoning
            frames.append(self.emit("response.reasoning_text.delta", item_id=self.response.output[self.open.index].id,
                                    output_index=self.open.index, content_index=0, delta=d.parts.reasoning))
        if d.parts.content:
            frames += self._text_item("message")
            assert self.open is not None
            self.open.text += d.parts.content
            # logprobs are served only without a parser: every token's text is this delta's
            lps = self.logprobs(d.logprobs) if self.logprobs is not None else []
            self.open.logprobs += lps
            frames.append(self.emit("response.output_text.delta", item_id=self.response.output[self.open.index].id,
                                    output_index=self.open.index, content_index=0, delta=d.parts.content,
                                    logprobs=lps))
        for call in d.parts.tool_calls:
            fn = call.get("function", {})
            if "id" in call:  # a new call: its id and name come first
                frames += self.close_text()
                item = FunctionCallItem(id=_item_id("fc"), call_id=call["id"], name=fn["name"], arguments="",
                                        status="in_progress")
                index, frame = self._add(item)
                self.calls[call["index"]] = index
                frames.append(frame)
            fragment = fn.get("arguments") or ""
            if fragment:
                index = self.calls[call["index"]]
                target = self.response.output[index]
                assert isinstance(target, FunctionCallItem)
                target.arguments += fragment
                frames.append(self.emit("response.function_call_arguments.delta", item_id=target.id,
                                        output_index=index, delta=fragment))
        return frames

    def close_all(self, cut: bool = False) -> list[bytes]:
        """Closes every open item; `cut`: the last one is "incomplete" (the reply ended at max_output_tokens)."""
        last = len(self.response.output) - 1
        frames = self.close_text(cut and self.open is not None and self.open.index == last)
        for index in self.calls.values():
            item = self.response.output[index]
            assert isinstance(item, FunctionCallItem)
            item.status = "incomplete" if cut and index == last else "completed"
            frames += [self.emit("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                 name=item.name, arguments=item.arguments),
                       self.emit("response.output_item.done", output_index=index, item=item)]
        return frames
