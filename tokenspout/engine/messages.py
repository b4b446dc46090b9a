"""Messages that cross the frontend <-> engine-core process boundary (msgspec msgpack, never pickle)."""

from __future__ import annotations

import msgspec

from tokenspout.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sequence for the engine core.  n > 1 is fanned out by the frontend into n of these,
    each with its own request_id and seed stream."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of one generated token: the sampled token's logprob and rank (1 = best),
    and the top-N alternatives (N = SamplingParams.logprobs), best first."""

    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of a run of prompt tokens, scored on one prefill chunk's logits: entry j is prompt token
    start + 1 + j given the tokens before it (the first prompt token has none).  Its logprob and rank (1 = best;
    tokens tied with it count, as in vLLM), then its position's top-N alternatives, best first, flattened
    (N = SamplingParams.prompt_logprobs, so entry j's are [j * N, (j + 1) * N))."""

    start: int  # the prompt position whose logits scored the first entry
    logprobs: list[float]
    ranks: list[int]
    top_token_ids: list[int]
    top_logprobs: list[float]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    # The stop token id that ended it (strings are found by the frontend).  With finish_reason "error": what was
    # wrong with the request, found only in the engine (a grammar this vocabulary cannot satisfy), which the
    # frontend raises as bad input (HTTP 400).  (No field of its own: an array-like struct writes every field, so
    # a new one would cost a byte on every output.)
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # the prompt tokens scored this step, when the request asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use
    num_preemptions: int = 0  # cumulative
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    # Speculative decoding, cumulative.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_emitted_tokens: int = 0
    # Prefix caching, cumulative, in tokens: looked up when sequences joined the running set, and found cached.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class RequestTimestamps(msgspec.Struct, array_like=True):
    """When the engine core queued a request (added it) and first scheduled it, on the engine core's clock
    (time.monotonic() in its process), for the queue / prefill / decode / inference-time metrics (vLLM sends the
    same as engine-core events).  The frontend subtracts them from one another and from EngineCoreOutputs'
    `timestamp` (the same clock), never from its own clock."""

    request_id: str
    queued_ts: float
    scheduled_ts: float


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    # Set when the engine core hit a fatal error; the frontend fails every in-flight request.
    engine_error: str | None = None
    # Timestamps of the requests whose first output is in this batch.  Per batch, not per output: msgspec encodes
    # every field of an array-like struct, so a field on EngineCoreOutput would cost bytes on every token.
    request_timestamps: list[RequestTimestamps] | None = None


class EngineCoreAbort(msgspec.Struct, array_like=True):
    request_ids: list[str]


class EngineCoreUtility(msgspec.Struct, array_like=True):
    """A utility call (e.g. 'get_stats', 'shutdown') answered with an EngineCoreOutputs carrying stats."""

    name: str
