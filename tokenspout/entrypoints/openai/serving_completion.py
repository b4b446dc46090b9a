"""POST /v1/completions: one or several prompts (text or token ids) → engine → one response or an SSE stream.

Choices are indexed prompt-major: prompt p, choice j → index p * n + j.  Every prompt is its own engine request
(`<id>-<p>`), all submitted at once and merged as their outputs arrive.

echo prepends the prompt text; with logprobs the prompt's tokens come first in `logprobs`, scored by the engine on
the prefill (SamplingParams.prompt_logprobs, vLLM's rule: prompt_logprobs if given, else logprobs), the first one
null as OpenAI reports it.  echo with max_tokens 0 returns the scored prompt alone (finish_reason "length").
vLLM's extra `prompt_logprobs: N` puts them on each choice as `prompt_logprobs` (not with stream, as vLLM).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from tokenspout.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    OpenAIServingError,
)
from tokenspout.entrypoints.openai.protocol.completion import CompletionStreamChoice, CompletionStreamResponse
from tokenspout.entrypoints.openai.request_ids import request_ids
from tokenspout.entrypoints.openai.serving_beam import beam_search_completion
from tokenspout.entrypoints.openai.serving_common import (
    EngineClient,
    LogprobBytes,
    PromptState,
    TextOffsets,
    check_model,
    merge_outputs,
    off_loop,
    prompt_logprobs_json,
    prompt_text,
    safe_logprob,
    special_tokens_kwargs,
    to_serving_error,
    token_str,
    usage_of,
)
from tokenspout.entrypoints.openai.sse import DONE_FRAME, ChunkEnvelope, error_frame, sse_frame
from tokenspout.metrics import ServerMetrics
from tokenspout.offload import Offloader
from tokenspout.outputs import Logprob, PositionLogprobs, RequestOutput
from tokenspout.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CompletionJob:
    request: CompletionRequest
    request_id: str  # the response's id
    engine_id: str  # the engine's base id (unique even when the client chose the id)
    prompts: list[str | list[int]]
    params: SamplingParams
    created: int


class OpenAIServingCompletion:
    def __init__(self, engine: EngineClient, metrics: ServerMetrics | None = None,
                 offloader: Offloader | None = None) -> None:
        """`offloader`: where a finished response is built (serving_common.off_loop; None: on the event loop)."""
        self.engine = engine
        self._token_bytes = LogprobBytes(engine)
        self.metrics = metrics
        self.offloader = offloader

    def prepare(self, req: CompletionRequest) -> CompletionJob:
        check_model(self.engine, req.model)
        if req.use_beam_search and (req.stream or not hasattr(self.engine, "processor")):
            raise OpenAIServingError("use_beam_search cannot be streamed" if req.stream
                                     else "use_beam_search is not supported by this engine", param="use_beam_search")
        prompts = req.prompts()
        params = req.to_sampling_params(getattr(self.engine, "default_sampling_params", None))
        return CompletionJob(req, *request_ids("cmpl", req.request_id), prompts, params, int(time.time()))

    def _start(self, job: CompletionJob,
               keep_text: bool) -> tuple[list[PromptState], AsyncGenerator[tuple[int, RequestOutput], None]]:
        states = [PromptState(job.params.n, job.params.output_kind, self.metrics, keep_text) for _ in job.prompts]
        kw = special_tokens_kwargs(job.request)
        gens = [self.engine.generate(p, job.params, f"{job.engine_id}-{i}", **kw) for i, p in enumerate(job.prompts)]
        return states, merge_outputs(gens)

    @staticmethod
    def _fail(states: list[PromptState], exc: Exception, started: bool) -> OpenAIServingError:
        err = to_serving_error(exc)
        for s in states:
            if err.status < 500 and not started:
                s.discard()  # rejected input: the request never ran
            else:
                s.finish("error")
        return err

    # ------------------------------------------------------------------------------------------ non-streaming
    async def complete(self, job: CompletionJob) -> CompletionResponse:
        req = job.request
        if req.use_beam_search:  # (counted in the metrics as its sampled twin would be: one request per prompt)
            states = [PromptState(req.n, RequestOutputKind.FINAL_ONLY, self.metrics, keep_text=False)
                      for _ in job.prompts]
            try:
                return await beam_search_completion(self.engine, job.engine_id, job.created, job.prompts, req.n,
                                                    job.params, req.length_penalty, req.echo, states)
            except Exception as e:
                raise self._fail(states, e, started=False) from e
            finally:
                for s in states:
                    s.finish("abort")  # no-op unless the client went away mid-search
        states, merged = self._start(job, keep_text=True)
        try:
            async with aclosing(merged) as outs:
                async for p, out in outs:
                    states[p].observe(out)
        except Exception as e:
            raise self._fail(states, e, started=False) from e
        finally:
            for s in states:
                s.finish("abort")  # no-op unless cancelled (client gone)
        return await off_loop(self.offloader, lambda: self._response(job, states))

    def _response(self, job: CompletionJob, states: list[PromptState]) -> CompletionResponse:
        req, n, top_n = job.request, job.params.n, job.params.logprobs
        choices = []
        for p, (prompt, state) in enumerate(zip(job.prompts, states, strict=True)):
            echo = prompt_text(self.engine, prompt, state) if req.echo else ""
            plp = prompt_logprobs_json(self.engine, state.prompt_logprobs) if req.shows_prompt_logprobs else None
            for j, c in enumerate(state.choices):
                logprobs = None
                if top_n is not None:
                    logprobs = CompletionLogprobs()
                    offsets = TextOffsets()
                    if req.echo:
                        self._echo_logprobs(logprobs, state, top_n, offsets, req.return_tokens_as_token_ids)
                    self._extend_logprobs(logprobs, c.logprobs, offsets, req.return_tokens_as_token_ids)
                ids = req.return_token_ids
                choices.append(CompletionChoice(index=p * n + j, text=echo + c.text, logprobs=logprobs,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                prompt_logprobs=plp,
                                                prompt_token_ids=state.prompt_token_ids if ids else None,
                                                token_ids=c.token_ids if ids else None))
        return CompletionResponse(id=job.request_id, created=job.created, model=self.engine.model_name,
                                  choices=choices, usage=usage_of(states))

    # ------------------------------------------------------------------------------------------ streaming
    async def stream(self, job: CompletionJob) -> AsyncIterator[bytes]:
        req, n, top_n, model = job.request, job.params.n, job.params.logprobs, self.engine.model_name
        states, merged = self._start(job, keep_text=False)
        offsets = [TextOffsets() for _ in range(len(job.prompts) * n)]  # text_offset of the next token, per choice
        started = False

        envelope = ChunkEnvelope(CompletionResponse(id=job.request_id, created=job.created, model=model, choices=[]))

        def chunk(index: int, text: str, logprobs: CompletionLogprobs | None = None, finish: str | None = None,
                  stop_reason: int | str | None = None, token_ids: list[int] | None = None,
                  prompt_token_ids: list[int] | None = None) -> bytes:
            choice = CompletionStreamChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish,
                                            stop_reason=stop_reason, token_ids=token_ids,
                                            prompt_token_ids=prompt_token_ids)
            if req.continuous_usage:  # vLLM's continuous_usage_stats: every chunk carries the usage so far
                return sse_frame(CompletionStreamResponse(id=job.request_id, created=job.created, model=model,
                                                          choices=[choice], usage=usage_of(states)))
            return envelope.frame(choice)

        sent_prompt_ids = [False] * (len(job.prompts) * n)  # return_token_ids: once per choice, first chunk

        def prompt_ids(index: int, state: PromptState) -> list[int] | None:
            if not req.return_token_ids or sent_prompt_ids[index]:
                return None
            sent_prompt_ids[index] = True
            return state.prompt_token_ids

        try:
            async with aclosing(merged) as outs:  # leaving early (client gone) closes every engine generator now
                async for p, out in outs:
                    started = True
                    state = states[p]
                    first = state.prompt_token_ids is None
                    state.observe(out)
                    if first and req.echo:
                        text = prompt_text(self.engine, job.prompts[p], state)
                        for j in range(n):
                            lp = None
                            if top_n is not None:
                                lp = CompletionLogprobs()
                                self._echo_logprobs(lp, state, top_n, offsets[p * n + j],
                                                    req.return_tokens_as_token_ids)
                            else:
                                offsets[p * n + j] = TextOffsets(len(text))
                            yield chunk(p * n + j, text, lp, prompt_token_ids=prompt_ids(p * n + j, state))
                    for c in out.outputs:
                        index = p * n + c.index
                        if c.text or c.token_ids:  # the finish_reason rides on the last token's chunk (as OpenAI)
                            lp = None
                            if top_n is not None:
                                lp = CompletionLogprobs()
                                self._extend_logprobs(lp, c.logprobs or [], offsets[index],
                                                      req.return_tokens_as_token_ids)
                            yield chunk(index, c.text, lp, c.finish_reason, c.stop_reason,
                                        token_ids=list(c.token_ids) if req.return_token_ids else None,
                                        prompt_token_ids=prompt_ids(index, state))
                        elif c.finish_reason is not None:
                            yield chunk(index, "", None, c.finish_reason, c.stop_reason,
                                        prompt_token_ids=prompt_ids(index, state))
            if req.include_usage:
                yield sse_frame(CompletionResponse(id=job.request_id, created=job.created, model=model, choices=[],
                                                   usage=usage_of(states)))
        except Exception as e:
            err = self._fail(states, e, started)
            if not started:
                raise err from e
            yield error_frame(err)
        finally:
            for s in states:
                s.finish("abort")  # no-op unless the client went away mid-stream
        yield DONE_FRAME

    # ------------------------------------------------------------------------------------------ legacy logprobs
    def _echo_logprobs(self, out: CompletionLogprobs, state: PromptState, top_n: int, offsets: TextOffsets,
                       as_ids: bool = False) -> None:
        """The prompt's tokens with their prompt logprobs (the first null, as OpenAI) and at most top_n + 1 entries
        in top_logprobs (the prompt token, then its position's best, as for generated tokens); their text offsets
        from `offsets` (counted on the tokens' bytes).  `as_ids`: return_tokens_as_token_ids, for the prompt's
        tokens as for the generated ones (as vLLM)."""
        tok = self.engine.tokenizer
        scored = state.prompt_logprobs or []
        for i, token_id in enumerate(state.prompt_token_ids or ()):
            pos = scored[i] if i < len(scored) else None
            if pos is None or token_id not in pos:
                text = tok.decode([token_id])
                out.tokens.append(f"token_id:{token_id}" if as_ids else text)
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                items: list[tuple[int, Logprob]] = list(pos.items())[: top_n + 1]  # the prompt token first
                text = token_str(self.engine, token_id, pos[token_id])
                out.tokens.append(token_str(self.engine, token_id, pos[token_id], as_ids))
                out.token_logprobs.append(safe_logprob(pos[token_id].logprob))
                out.top_logprobs.append({token_str(self.engine, t, tl, as_ids): safe_logprob(tl.logprob)
                                         for t, tl in items})
            out.text_offset.append(offsets.take(self._token_bytes(token_id, text)))

    def _extend_logprobs(self, out: CompletionLogprobs, positions: list[PositionLogprobs], offsets: TextOffsets,
                         as_ids: bool = False) -> None:
        """Appends generated positions (sampled token + its alternatives) and their text offsets (counted on the
        tokens' bytes, also when the tokens are shown as "token_id:N")."""
        for pos in positions:
            items: list[tuple[int, Logprob]] = list(pos.items())
            token_id, lp = items[0]  # the sampled token comes first
            text = token_str(self.engine, token_id, lp)
            out.tokens.append(token_str(self.engine, token_id, lp, as_ids))
            out.token_logprobs.append(safe_logprob(lp.logprob))
            out.top_logprobs.append({token_str(self.engine, t, tl, as_ids): safe_logprob(tl.logprob)
                                     for t, tl in items})
            out.text_offset.append(offsets.take(self._token_bytes(token_id, text)))
