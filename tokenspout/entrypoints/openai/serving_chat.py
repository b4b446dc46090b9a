"""POST /v1/chat/completions: chat template → engine → one response or an SSE stream of chunks.

Stream shape (as OpenAI): per choice a first chunk with delta {role: "assistant", content: ""}, then content chunks
(with logprobs.content when asked), then a chunk with an empty delta and the finish_reason (+ vLLM's stop_reason);
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
    OpenAIServingError,
    TopLogprob,
)
from tokenspout.entrypoints.openai.serving_common import (
    EngineClient,
    PromptState,
    check_model,
    merge_outputs,
    prompt_logprobs_json,
    random_id,
    safe_logprob,
    to_serving_error,
    token_str,
    usage_of,
)
from tokenspout.entrypoints.openai.sse import DONE_FRAME, ChunkEnvelope, error_frame, sse_frame
from tokenspout.metrics import ServerMetrics
from tokenspout.outputs import CompletionOutput, PositionLogprobs
from tokenspout.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ChatJob:
    request: ChatCompletionRequest
    request_id: str
    prompt: str
    params: SamplingParams
    created: int
    echo: str = ""  # the text the reply starts with (echo)


class OpenAIServingChat:
    def __init__(self, engine: EngineClient, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics

    def prepare(self, req: ChatCompletionRequest) -> ChatJob:
        """Everything that can fail before the engine sees the request (raises OpenAIServingError)."""
        check_model(self.engine, req.model)
        messages = req.template_messages()
        params = req.to_sampling_params()
        kwargs = dict(req.chat_template_kwargs or {})
        if req.continue_final_message:
            kwargs["continue_final_message"] = True
        try:
            prompt = self.engine.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt and not req.continue_final_message, **kwargs
            )
        except (ValueError, TypeError) as e:
            raise OpenAIServingError(f"messages could not be rendered with the chat template: {e}",
                                     param="messages") from None
        if params.uses_guidance and params.negative_prompt is None:
            # CFG's default unconditional prompt for chat: the template around an empty user message.
            params.negative_prompt = self.engine.apply_chat_template([{"role": "user", "content": ""}])
        return ChatJob(req, random_id("chatcmpl"), prompt, params, int(time.time()), self._echo(req, messages))

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
            async with aclosing(merge_outputs([self.engine.generate(job.prompt, job.params, job.request_id)])) as outs:
                async for _, out in outs:
                    state.observe(out)
        except Exception as e:
            err = to_serving_error(e)
            if err.status < 500:
                state.discard()  # rejected input: the request never ran
            else:
                state.finish("error")
            raise err from e
        finally:
            state.finish("abort")  # no-op unless cancelled (client gone)
        top_n = job.params.logprobs
        choices = [
            ChatCompletionChoice(
                index=i,
                message=ChatResponseMessage(role="assistant", content=job.echo + c.text),
                logprobs=self._logprobs(c.logprobs, top_n) if top_n is not None else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for i, c in enumerate(state.choices)
        ]
        return ChatCompletionResponse(
            id=job.request_id, created=job.created, model=self.engine.model_name, choices=choices,
            usage=usage_of([state]), prompt_logprobs=prompt_logprobs_json(self.engine, state.prompt_logprobs),
        )

    # ------------------------------------------------------------------------------------------ streaming
    async def stream(self, job: ChatJob) -> AsyncIterator[bytes]:
        """SSE frames.  Errors before the first frame are raised (→ JSON error with its status); later ones become
        an error frame followed by [DONE]."""
        params, model = job.params, self.engine.model_name
        state = PromptState(params.n, params.output_kind, self.metrics, keep_text=False)
        started = False

        envelope = ChunkEnvelope(ChatCompletionChunk(id=job.request_id, created=job.created, model=model, choices=[]))

        try:
            # aclosing: leaving this generator early (client gone) must close the engine generator now, not at GC.
            async with aclosing(merge_outputs([self.engine.generate(job.prompt, params, job.request_id)])) as outs:
                async for _, out in outs:
                    if not started:
                        started = True
                        for i in range(params.n):
                            role = DeltaMessage(role="assistant", content="")
                            yield envelope.frame(ChatCompletionStreamChoice(index=i, delta=role))
                        if job.echo:
                            for i in range(params.n):
                                yield envelope.frame(ChatCompletionStreamChoice(
                                    index=i, delta=DeltaMessage(content=job.echo)))
                    state.observe(out)
                    for c in out.outputs:
                        for frame in self._choice_frames(c, params.logprobs):
                            yield envelope.frame(frame)
            if job.request.include_usage:
                yield sse_frame(ChatCompletionChunk(id=job.request_id, created=job.created, model=model, choices=[],
                                                    usage=usage_of([state])))
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

    def _choice_frames(self, c: CompletionOutput, top_n: int | None) -> list[ChatCompletionStreamChoice]:
        frames = []
        if c.text or c.token_ids:
            frames.append(ChatCompletionStreamChoice(
                index=c.index,
                delta=DeltaMessage(content=c.text),
                logprobs=self._logprobs(c.logprobs or [], top_n) if top_n is not None else None,
            ))
        if c.finish_reason is not None:
            frames.append(ChatCompletionStreamChoice(
                index=c.index, delta=DeltaMessage(), finish_reason=c.finish_reason, stop_reason=c.stop_reason
            ))
        return frames

    def _logprobs(self, positions: list[PositionLogprobs], top_n: int) -> ChatChoiceLogprobs:
        content = []
        for pos in positions:
            items = list(pos.items())
            token_id, lp = items[0]  # the sampled token comes first
            text = token_str(self.engine, token_id, lp)
            tops = sorted(items, key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)[:top_n]
            content.append(ChatTokenLogprob(
                token=text,
                logprob=safe_logprob(lp.logprob),
                bytes=list(text.encode("utf-8", errors="replace")),
                top_logprobs=[
                    TopLogprob(token=(t := token_str(self.engine, tid, tlp)), logprob=safe_logprob(tlp.logprob),
                               bytes=list(t.encode("utf-8", errors="replace")))
                    for tid, tlp in tops
                ],
            ))
        return ChatChoiceLogprobs(content=content)
