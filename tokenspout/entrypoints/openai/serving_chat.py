"""POST /v1/chat/completions: chat template → engine → one response or an SSE stream of chunks.

Stream shape (as OpenAI): per choice a first chunk with delta {role: "assistant", content: ""}, then content chunks
(with logprobs.content when asked), the last of them with the finish_reason (+ vLLM's stop_reason; a chunk with an
empty delta only when the last output released nothing);
a usage chunk with `choices: []` only when stream_options.include_usage; then `data: [DONE]`.

vLLM extras: `prompt_logprobs: N` answers with a top-level `prompt_logprobs` (not with stream); `echo: true` starts
the reply with the last message's content when that message has the reply's role ("assistant" with
add_generation_prompt, else the last message's own role, e.g. with continue_final_message), streamed as a chunk of
its own after the role chunk.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from tokenspout import guidance
from tokenspout.engine.chat_output import ChatOutputParser, tool_finish_reason
from tokenspout.engine.chat_tools import (
    ChatPlan,
    check_parser_names,
    constrain,
    effective_template,
    plan_chat,
    special_token_ids,
    template_tool_messages,
    tools_template,
)
from tokenspout.entrypoints.openai.chat_render import check_request_template, render_chat_prompt, request_template
from tokenspout.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatResponseMessage,
    ChatTokenLogprob,
    DeltaMessage,
    FunctionCall,
    OpenAIServingError,
    ToolCall,
    TopLogprob,
    UsageInfo,
    value_error_to_serving_error,
)
from tokenspout.entrypoints.openai.request_ids import request_ids
from tokenspout.entrypoints.openai.serving_common import (
    ChoiceState,
    EngineClient,
    LogprobBytes,
    PromptState,
    check_model,
    merge_outputs,
    off_loop,
    prompt_logprobs_json,
    safe_logprob,
    special_tokens_kwargs,
    to_serving_error,
    token_str,
    usage_of,
)
from tokenspout.entrypoints.openai.sse import DONE_FRAME, ChunkEnvelope, error_frame, sse_frame
from tokenspout.metrics import ServerMetrics
from tokenspout.offload import Offloader
from tokenspout.outputs import CompletionOutput, PositionLogprobs
from tokenspout.reasoning import ReasoningParser, reasoning_parser_class
from tokenspout.reasoning.budget import apply_budget
from tokenspout.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ChatJob:
    request: ChatCompletionRequest
    request_id: str  # the response's id
    engine_id: str  # the engine's (unique even when the client chose the id)
    prompt: str
    params: SamplingParams
    created: int
    echo: str = ""  # the text the reply starts with (echo)
    plan: ChatPlan | None = None  # tool calls / reasoning to parse out of the reply


_TOOL_FIELDS = {"tools", "tool_choice", "parallel_tool_calls", "response_format"}


class OpenAIServingChat:
    def __init__(self, engine: EngineClient, metrics: ServerMetrics | None = None, *,
                 tool_call_parser: str | None = "auto", reasoning_parser: str | None = None,
                 trust_request_chat_template: bool = False, offloader: Offloader | None = None) -> None:
        """`tool_call_parser`: --tool-call-parser (a parser name, "auto" = by the chat template, None = no tool
        calls); `reasoning_parser`: --reasoning-parser (None = reasoning stays in content);
        `trust_request_chat_template`: --trust-request-chat-template (chat_render.py); `offloader`: where a
        finished response is built (serving_common.off_loop; None: on the event loop)."""
        self.engine = engine
        self.offloader = offloader
        self.trust_request_chat_template = trust_request_chat_template
        self.metrics = metrics
        self.tool_call_parser = tool_call_parser
        check_parser_names(tool_call_parser, reasoning_parser)  # an unknown name fails at startup
        self.reasoning_cls: type[ReasoningParser] | None = reasoning_parser_class(reasoning_parser)
        self._special_ids: dict[str, int] | None = None
        self._token_bytes = LogprobBytes(engine)

    def _plan(self, req: ChatCompletionRequest, template_kwargs: dict, chat_template: str | None) -> ChatPlan | None:
        """The tool parser for `req` (None without tools or with tool_choice "none"); adds `tools` to the
        template's arguments when the template renders them."""
        if req.tools is None and req.tool_choice is None:
            return None
        try:
            return plan_chat(req.tool_dicts(), req.tool_choice_value(), req.parallel_tool_calls,
                             template=effective_template(self.engine, chat_template),
                             parser_name=self.tool_call_parser, template_kwargs=template_kwargs)
        except ValueError as e:
            raise value_error_to_serving_error(e, _TOOL_FIELDS) from None

    def prepare(self, req: ChatCompletionRequest) -> ChatJob:
        """Everything that can fail before the engine sees the request (raises OpenAIServingError)."""
        check_model(self.engine, req.model)
        own = request_template(req.chat_template, req.chat_template_kwargs)
        check_request_template(own, self.trust_request_chat_template)
        messages = req.template_messages()
        params = req.to_sampling_params(getattr(self.engine, "default_sampling_params", None))
        template_kwargs = dict(req.chat_template_kwargs or {})
        # the bundled tools template, for tools on a ChatML template that never renders them (the server's choice)
        fallback = None if own is not None else tools_template(self.engine, None, req.tools)
        plan = self._plan(req, template_kwargs, own or fallback) or ChatPlan()
        if plan.tool_parser is not None or req.tools:
            messages = template_tool_messages(messages)
        prompt = render_chat_prompt(self.engine, messages, add_generation_prompt=req.add_generation_prompt,
                                    continue_final_message=req.continue_final_message,
                                    chat_template_kwargs=template_kwargs, chat_template=req.chat_template,
                                    trusted=self.trust_request_chat_template, server_template=fallback)
        if self.reasoning_cls is not None:
            plan.reasoning = self.reasoning_cls(str(prompt))
        try:
            constrain(params, plan.tool_parser, req.tool_dicts(), req.tool_choice_value(), req.parallel_tool_calls,
                      plan.reasoning, self._special_token_ids())
        except ValueError as e:
            raise value_error_to_serving_error(e, _TOOL_FIELDS) from None
        try:
            apply_budget(params, plan.reasoning)
        except ValueError as e:  # name the field the client sent
            name = "reasoning_effort" if req.reasoning_effort is not None else "thinking_token_budget"
            raise OpenAIServingError(str(e).replace("thinking_token_budget", name, 1), param=name) from None
        if params.uses_guidance and params.negative_prompt is None:
            params.negative_prompt = guidance.chat_negative_prompt(self.engine.apply_chat_template)
        return ChatJob(req, *request_ids("chatcmpl", req.request_id), prompt, params, int(time.time()),
                       self._echo(req, messages), plan if plan.active else None)

    def _special_token_ids(self) -> dict[str, int]:
        if self._special_ids is None:
            self._special_ids = special_token_ids(self.engine.tokenizer)
        return self._special_ids

    @staticmethod
    def _echo(req: ChatCompletionRequest, messages: list[dict[str, str]]) -> str:
        """vLLM's rule: the reply's role is "assistant" when a generation prompt is added, else the last message's;
        echo repeats the last message's content when it has that role."""
        if not req.echo:
            return ""
        role = "assistant" if req.add_generation_prompt and not req.continue_final_message else messages[-1]["role"]
        return messages[-1]["content"] if messages[-1]["role"] == role else ""

    # ------------------------------------------------------------------------------------------ non-streaming
    async def complete(self, job: ChatJob) -> ChatCompletionResponse:
        state = PromptState(job.params.n, job.params.output_kind, self.metrics, keep_text=True)
        try:
            gen = self.engine.generate(job.prompt, job.params, job.engine_id, **special_tokens_kwargs(job.request))
            async with aclosing(merge_outputs([gen])) as outs:
                async for _, out in outs:
                    state.observe(out)
        except Exception as e:
            err = state.failed(e)  # a 4xx: rejected input, the request never ran
            raise err from e
        finally:
            state.finish("abort")  # no-op unless cancelled (client gone)
        return await off_loop(self.offloader, lambda: self._response(job, state))

    def _response(self, job: ChatJob, state: PromptState) -> ChatCompletionResponse:
        top_n, req = job.params.logprobs, job.request
        messages = [self._message(job, c) for c in state.choices]
        choices = [
            ChatCompletionChoice(
                index=i,
                message=messages[i],
                logprobs=self._logprobs(c.logprobs, top_n, req.return_tokens_as_token_ids)
                if top_n is not None else None,
                finish_reason=tool_finish_reason(c.finish_reason, c.stop_reason, bool(messages[i].tool_calls)),
                stop_reason=c.stop_reason,
                token_ids=c.token_ids if req.return_token_ids else None,
            )
            for i, c in enumerate(state.choices)
        ]
        return ChatCompletionResponse(
            id=job.request_id, created=job.created, model=self.engine.model_name, choices=choices,
            usage=usage_of([state]), prompt_token_ids=state.prompt_token_ids if req.return_token_ids else None,
            prompt_logprobs=prompt_logprobs_json(self.engine, state.prompt_logprobs),
        )

    @staticmethod
    def _message(job: ChatJob, c: ChoiceState) -> ChatResponseMessage:
        if job.plan is None:
            return ChatResponseMessage(role="assistant", content=job.echo + c.text)
        parts = job.plan.final(c.text)
        calls = parts.tool_calls
        content = parts.content if not job.echo else job.echo + (parts.content or "")
        return ChatResponseMessage(
            role="assistant", content=content, reasoning_content=parts.reasoning, reasoning=parts.reasoning,
            tool_calls=[ToolCall(id=t["id"], function=FunctionCall(**t["function"])) for t in calls])

    # ------------------------------------------------------------------------------------------ streaming
    async def stream(self, job: ChatJob) -> AsyncIterator[bytes]:
        """SSE frames.  Errors before the first frame are raised (→ JSON error with its status); later ones become
        an error frame followed by [DONE]."""
        params, model, req = job.params, self.engine.model_name, job.request
        state = PromptState(params.n, params.output_kind, self.metrics, keep_text=False)
        started = False
        parsers = [job.plan.output_parser() for _ in range(params.n)] if job.plan is not None else None

        def chunk(*choices: ChatCompletionStreamChoice, usage: UsageInfo | None = None,
                  prompt_token_ids: list[int] | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=job.request_id, created=job.created, model=model, choices=list(choices),
                                       usage=usage, prompt_token_ids=prompt_token_ids)

        envelope = ChunkEnvelope(chunk())

        def frame(*choices: ChatCompletionStreamChoice, no_tokens: bool = False,
                  prompt_token_ids: list[int] | None = None) -> bytes:
            if req.continuous_usage:  # vLLM's continuous_usage_stats: every chunk carries the usage so far
                usage = usage_of([state])
                if no_tokens:  # the role and echo chunks carry no generated token (vLLM counts none for them)
                    usage.completion_tokens, usage.total_tokens = 0, usage.prompt_tokens
                return sse_frame(chunk(*choices, usage=usage, prompt_token_ids=prompt_token_ids))
            if prompt_token_ids is not None:
                return sse_frame(chunk(*choices, prompt_token_ids=prompt_token_ids))
            return envelope.frame(*choices)

        try:
            # aclosing: leaving this generator early (client gone) must close the engine generator now, not at GC.
            gen = self.engine.generate(job.prompt, params, job.engine_id, **special_tokens_kwargs(req))
            async with aclosing(merge_outputs([gen])) as outs:
                async for _, out in outs:
                    first = not started
                    started = True
                    state.observe(out)
                    if first:
                        for i in range(params.n):
                            role = ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                            # vLLM: with return_token_ids the prompt's ids ride on the first chunk
                            ids = out.prompt_token_ids if req.return_token_ids and i == 0 else None
                            yield frame(role, no_tokens=True, prompt_token_ids=ids)
                        if job.echo:
                            for i in range(params.n):
                                yield frame(ChatCompletionStreamChoice(index=i, delta=DeltaMessage(content=job.echo)),
                                            no_tokens=True)
                    for c in out.outputs:
                        for choice in self._choice_frames(c, params.logprobs, req,
                                                          parsers[c.index] if parsers else None):
                            yield frame(choice)
            if req.include_usage:
                yield sse_frame(chunk(usage=usage_of([state])))
        except Exception as e:
            err = to_serving_error(e)
            if err.status < 500 and not started:
                state.discard()  # rejected input: the request never ran
            else:
                state.finish("error")
            if not started:
                raise err from e
            yield error_frame(err)
        finally:
            state.finish("abort")  # no-op unless the client went away mid-stream
        yield DONE_FRAME

    def _choice_frames(self, c: CompletionOutput, top_n: int | None, req: ChatCompletionRequest,
                       parser: ChatOutputParser | None = None) -> list[ChatCompletionStreamChoice]:
        frames = []
        finish_reason = c.finish_reason
        if parser is None:
            delta = DeltaMessage(content=c.text)
        else:
            parts = parser.delta(c.text, c.finish_reason is not None)
            delta = DeltaMessage(content=parts.content or None, tool_calls=parts.tool_calls or None,
                                 reasoning_content=parts.reasoning or None, reasoning=parts.reasoning or None)
            finish_reason = tool_finish_reason(finish_reason, c.stop_reason, parser.called_tools)
        if parser is None:
            send = bool(c.text or c.token_ids)
        else:  # what the parser releases (held-back text is released at the end), or the tokens' own fields
            send = bool(parts) or (bool(c.text or c.token_ids) and (top_n is not None or req.return_token_ids))
        # As OpenAI and vLLM: the finish_reason rides on the last token's chunk (a chunk of its own, with an empty
        # delta, only when the last output carries nothing to send).
        if send:
            frames.append(ChatCompletionStreamChoice(
                index=c.index,
                delta=delta,
                logprobs=self._logprobs(c.logprobs or [], top_n, req.return_tokens_as_token_ids)
                if top_n is not None else None,
                token_ids=list(c.token_ids) if req.return_token_ids else None,
                finish_reason=finish_reason, stop_reason=c.stop_reason,
            ))
        elif c.finish_reason is not None:
            frames.append(ChatCompletionStreamChoice(
                index=c.index, delta=DeltaMessage(), finish_reason=finish_reason, stop_reason=c.stop_reason
            ))
        return frames

    def token_logprobs(self, positions: list[PositionLogprobs], top_n: int) -> list[ChatTokenLogprob]:
        """Chat's logprob entries of `positions` (what the Responses API's output_text.logprobs hold too)."""
        return self._logprobs(positions, top_n).content or []

    def _logprobs(self, positions: list[PositionLogprobs], top_n: int, as_ids: bool = False) -> ChatChoiceLogprobs:
        content = []
        for pos in positions:
            items = list(pos.items())
            token_id, lp = items[0]  # the sampled token comes first
            text = token_str(self.engine, token_id, lp, as_ids)
            tops = sorted(items, key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)[:top_n]
            content.append(ChatTokenLogprob(
                token=text,
                logprob=safe_logprob(lp.logprob),
                bytes=self._bytes(token_id, text, as_ids),
                top_logprobs=[
                    TopLogprob(token=(t := token_str(self.engine, tid, tlp, as_ids)), logprob=safe_logprob(tlp.logprob),
                               bytes=self._bytes(tid, t, as_ids))
                    for tid, tlp in tops
                ],
            ))
        return ChatChoiceLogprobs(content=content)

    def _bytes(self, token_id: int, text: str, as_ids: bool) -> list[int]:
        """A logprob entry's `bytes`: the token's own; with return_tokens_as_token_ids those of its text (vLLM)."""
        return list(text.encode("utf-8", errors="replace") if as_ids else self._token_bytes(token_id, text))
