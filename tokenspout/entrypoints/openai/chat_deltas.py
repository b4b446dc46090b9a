"""One prepared chat job's reply as parsed deltas (reasoning, content, tool-call fragments), for the front doors
whose streams are not chat chunks (OpenAI Responses, Anthropic Messages).

It runs the very engine request the chat route runs (`OpenAIServingChat.prepare` made the job: template, tool
grammar, reasoning parser) and reads it with the same ChatOutputParser, so a Responses or Messages stream carries
exactly what a chat stream would.  Only n = 1 (neither API has choices).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from tokenspout.engine.chat_output import DeltaParts, tool_finish_reason
from tokenspout.entrypoints.openai.serving_chat import ChatJob
from tokenspout.entrypoints.openai.serving_common import (
    EngineClient,
    PromptState,
    merge_outputs,
    special_tokens_kwargs,
)
from tokenspout.outputs import PositionLogprobs


@dataclass(slots=True)
class ChatDelta:
    parts: DeltaParts
    finish_reason: str | None = None  # on the last delta: "stop" | "length" | "tool_calls" | "abort"
    stop_reason: int | str | None = None  # the matched stop string or stop token id
    logprobs: list[PositionLogprobs] = field(default_factory=list)  # this delta's tokens (when asked for)


async def chat_deltas(engine: EngineClient, job: ChatJob, state: PromptState) -> AsyncIterator[ChatDelta]:
    """The reply's deltas; `state` counts usage and records metrics (the caller finishes or discards it).  The
    engine reports bad input at the first output, so an error raised before the first delta means nothing ran."""
    parser = job.plan.output_parser() if job.plan is not None else None
    gen = engine.generate(job.prompt, job.params, job.engine_id, **special_tokens_kwargs(job.request))
    # aclosing: a consumer that stops early (client gone) closes the engine generator now, so the engine aborts.
    async with aclosing(merge_outputs([gen])) as outs:
        async for _, out in outs:
            state.observe(out)
            for c in out.outputs:
                final = c.finish_reason is not None
                parts = parser.delta(c.text, final) if parser is not None else DeltaParts(content=c.text)
                reason = tool_finish_reason(c.finish_reason, c.stop_reason,
                                            parser is not None and parser.called_tools)
                yield ChatDelta(parts, reason, c.stop_reason, list(c.logprobs or ()))
