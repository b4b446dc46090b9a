"""POST /v1/chat/completions: chat template → engine → one response or an SSE stream of chunks.

Stream shape (as OpenAI): per choice a first chunk with delta {role: "assistant", content: ""}, then content chunks
(with logprobs.content when asked), then a chunk with an empty delta and the finish_reason (+ vLLM's stop_reason);
a usage chunk with `choices: []` only when stream_options.include_usage; then `data: [DONE]`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from tokenspout.entrypoints.openai.chat_render import render_chat_prompt
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
    TopLogprob,
)
from tokenspout.entrypoints.openai.request_ids import request_ids
from tokenspout.entrypoints.openai.serving_common import (
    EngineClient,
    PromptState,
    check_model,
    merge_outputs,
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
    engine_request_id: str  # request_id, or with a random suffix when the client chose the id (it may repeat)


class OpenAIServingChat:
    def __init__(self, engine: EngineClient, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics

    def prepare(self, req: ChatCompletionRequest) -> ChatJob:
        """Everything that can fail before the engine sees the request (raises OpenAIServingError)."""
        check_model(self.engine, req.model)
        messages = req.template_messages()
        params = req.to_sampling_params()
        prompt = render_chat_prompt(self.engine, messages, add_generation_prompt=req.add_generation_prompt,
                                    continue_final_message=req.continue_final_message,
                                    chat_template_kwargs=req.chat_template_kwargs)
        if params.uses_guidance and params.negative_prompt is None:
            # CFG's default unconditional prompt for chat: the template around an empty user message.
            params.negative_prompt = self.engine.apply_chat_template([{"role": "user", "content": ""}])
        response_id, engine_id = request_ids("chatcmpl", getattr(req, "request_id", None))
        return ChatJob(req, response_id, prompt, params, int(time.time()), engine_id)

    # ------------------------------------------------------------------------------------------ non-streaming
    async def complete(self, job: ChatJob) -> ChatCompletionResponse:
        state = PromptState(job.params.n, job.params.output_kind, self.metrics, keep_text=True)
        try:
            gen = self.engine.generate(job.prompt, job.params, job.engine_request_id)
            async with aclosing(merge_outputs([gen])) as outs:
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
                message=ChatResponseMessage(role="assistant", content=c.text),
                logprobs=self._logprobs(c.logprobs, top_n) if top_n is not None else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for i, c in enumerate(state.choices)
        ]
        return ChatCompletionResponse(
            id=job.request_id, created=job.created, model=self.engine.model_name, choices=choices,
            usage=usage_of([state]),
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
            gen = self.engine.generate(job.prompt, params, job.engine_request_id)
            async with aclosing(merge_outputs([gen])) as outs:
                async for _, out in outs:
                    if not started:
                        started = True
                        for i in range(params.n):
                            role = DeltaMessage(role="assistant", content="")
                            yield envelope.frame(ChatCompletionStreamChoice(index=i, delta=role))
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
