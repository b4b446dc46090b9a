"""What the frontend returns to users (offline LLM and AsyncLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position: token id -> Logprob (the sampled, or for prompt logprobs the prompt's, token first, then the top-N).
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class RequestMetrics:
    """Timings of one engine request (one choice), on its final CompletionOutput (vLLM's RequestOutput.metrics).
    Each is a difference on one clock: `first_token_latency` on the frontend's (arrival to first token processed),
    the phases on the engine core's (queued -> first scheduled -> first token -> last token); None when unknown
    (e.g. no token was produced)."""

    first_token_latency: float | None = None
    queued_time: float | None = None  # queued in the engine core until first scheduled
    prefill_time: float | None = None  # first scheduled until the first token
    decode_time: float | None = None  # first token until the last
    inference_time: float | None = None  # first scheduled until the last token (prefill + decode)
    max_tokens_param: int | None = None  # the request's effective max_tokens


@dataclass(slots=True)
class MessageParts:
    """A chat reply as the tool-call and reasoning parsers read it (engine/chat_output.py)."""

    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's shape: id, type, function


@dataclass(slots=True)
class CompletionOutput:
    index: int  # choice index (0 .. n-1)
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended the choice
    metrics: RequestMetrics | None = field(default=None, compare=False)  # set once the choice finished
    message: MessageParts | None = None  # LLM.chat with tools or a reasoning parser: the parsed reply

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """With RequestOutputKind.DELTA, `outputs` holds the choices that changed and their text/token_ids/logprobs
    are only the new part; with CUMULATIVE they hold everything so far; FINAL_ONLY yields once at the end."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: one entry per prompt token, the first None (nothing precedes it).  With DELTA
    # only the first output carries them.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
