"""What one engine step hands between the scheduler (core/) and the model runner (worker/), as vLLM's
v1/outputs.py: the scheduler's output in, the runner's output back.  A neutral module, so that worker/ imports
nothing of core/: the runner sees a scheduled sequence only through `StepSequence`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tokenspout.engine.messages import PromptLogprobs, TokenLogprobs
from tokenspout.sample.ops.mirostat import MirostatState
from tokenspout.sampling_params import SamplingParams


class StepSequence(Protocol):
    """What the model runner reads of a scheduled sequence (core.request.Request is one)."""

    @property
    def request_id(self) -> str: ...

    @property
    def params(self) -> SamplingParams: ...

    @property
    def seed(self) -> int: ...

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def companion(self) -> StepSequence | None: ...

    @property
    def mirostat(self) -> MirostatState | None: ...


@dataclass(slots=True)
class ScheduledRequest:
    """One sequence's share of a step.  What the model runner reads is copied here when the step is scheduled
    (with async scheduling the scheduler goes on changing the Request while the step runs)."""

    request: StepSequence
    num_new_tokens: int  # tokens whose KV this step computes, from position `start`
    samples: bool  # True when this step reaches the end of the known tokens, so a token is sampled
    spec_token_ids: list[int]  # drafts verified this step (after the known tokens)
    start: int  # position of the first new token
    # The new tokens the scheduler knows (num_new_tokens - len(spec_token_ids) of them, or one fewer when
    # `placeholder`: then the last input is the token the step in flight samples for this request, which the
    # model runner takes from that step's output without a trip through Python).
    token_ids: list[int]
    placeholder: bool
    # The sequence's KV blocks, the KV cache manager's own list: read by ModelRunner.prepare() at once, on the
    # scheduling thread, before the scheduler changes it again.
    block_ids: list[int] = field(default_factory=list)
    prompt_lp: tuple[int, int] | None = None  # prompt positions [lo, hi) whose logits this step scores


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Requests that left the running set since the last step (finished, aborted or preempted): the model runner
    # releases their rows.
    removed_request_ids: list[str] = field(default_factory=list)
    total_num_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class ModelRunnerOutput:
    """Per scheduled-and-sampling request: the tokens it emitted this step and their logprobs (if asked)."""

    sampled: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)  # the prompt tokens scored this step
