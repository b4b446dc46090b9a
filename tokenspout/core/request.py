"""Engine-side request state."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from tokenspout.engine.messages import EngineCoreRequest
from tokenspout.sample.ops.mirostat import MirostatState
from tokenspout.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenspout.spec_decode.speculator import SpecState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


class Request:
    """A sequence in the engine: its tokens (prompt then output), how many have KV computed, and its status."""

    __slots__ = (
        "arrival_time",
        "block_hashes",
        "companion",
        "is_companion",
        "max_len",
        "mirostat",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_inflight_tokens",
        "num_placeholders",
        "num_preemptions",
        "num_prompt_tokens",
        "params",
        "prompt_lp_next",
        "queued_ts",
        "request_id",
        "scheduled_ts",
        "seed",
        "spec_state",
        "spec_token_ids",
        "status",
        "stop_ids",
        "stop_reason",
        "token_ids",
    )

    def __init__(self, req: EngineCoreRequest, seed: int, max_model_len: int):
        self.request_id = req.request_id
        self.params: SamplingParams = req.sampling_params
        self.arrival_time = req.arrival_time
        # Engine-core clock (time.monotonic()) when it was queued here and when first scheduled (0: not yet; a
        # resumption after preemption keeps the first), reported with its first output (metrics).
        self.queued_ts = time.monotonic()
        self.scheduled_ts = 0.0
        self.num_prompt_tokens = len(req.prompt_token_ids)
        self.token_ids: list[int] = list(req.prompt_token_ids)
        self.num_computed_tokens = 0
        # Async scheduling (the next step is scheduled before this one's results are in): tokens whose KV steps
        # in flight are computing, and tokens those steps are sampling, whose ids the scheduler does not know yet.
        # Both are 0 whenever no step is in flight (always, with synchronous scheduling).
        self.num_inflight_tokens = 0
        self.num_placeholders = 0
        # Prefix caching: the chain hashes of this sequence's full blocks (kept across preemption: its tokens never
        # change), and how many prompt tokens its first admission found cached (reported with its outputs).
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens = 0
        self.status = RequestStatus.WAITING
        self.seed = seed  # effective sampling seed, kept across preemption so the draw stays reproducible
        # Mirostat's running target (None when off): the sampler updates it each step; it lives here so that a
        # preempted request resumes with it.
        self.mirostat = MirostatState.initial(self.params.mirostat, self.params.mirostat_tau)
        self.stop_reason: int | str | None = None
        max_tokens = self.params.max_tokens
        total = max_model_len if max_tokens is None else min(max_model_len, self.num_prompt_tokens + max_tokens)
        self.max_len = total  # the request ends ("length") when it holds this many tokens
        self.stop_ids = self.params.all_stop_token_ids
        self.num_preemptions = 0
        # Prompt logprobs: the first prompt position whose logits are still to be scored and sent (positions
        # 0 .. num_prompt_tokens - 2 score the next prompt token; the last one samples).  Kept across preemption,
        # so a recomputed prefill does not send its prompt logprobs twice.
        self.prompt_lp_next = 0 if self.params.prompt_logprobs is not None else self.num_prompt_tokens
        # Classifier-free guidance (tokenspout/guidance.py): the unconditional companion sequence (its own tokens
        # and KV blocks), scheduled together with this request; it never samples and takes this request's tokens.
        self.companion: Request | None = None
        self.is_companion = False
        # Speculative decoding: the drafts proposed for the next step (Scheduler.update_draft_token_ids), and the
        # speculation history, owned by spec_decode/policy.py (None until its first decision).
        self.spec_token_ids: list[int] = []
        self.spec_state: SpecState | None = None

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt positions still to score (never for a CFG companion, which shares its request's params)."""
        return not self.is_companion and self.prompt_lp_next < self.num_prompt_tokens - 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens whose KV is computed or being computed: where the next step's tokens start."""
        return self.num_computed_tokens + self.num_inflight_tokens

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Tokens the sequence holds once the steps in flight return (without any that ends it)."""
        return len(self.token_ids) + self.num_placeholders

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]
