"""Speculative decoding on the engine side, end to end: which requests draft (policy.py), the proposers (n-gram
lookups, ngram_proposer.py, or one batched draft-model run, draft_model.py), and the verification rounds' outcomes
fed back to the policy.  The verification itself runs in the model runner (worker/spec_verify.py) with the
rejection sampler (sample/rejection_sampler.py).

The engine core makes one call after each synchronous step, `propose_draft_token_ids(...)`, then hands
`take_draft_token_ids()` to the scheduler, which puts them in the next step (vLLM v1's shape).  Drafts are built
from the tokens of the step just done, so a speculating engine always steps synchronously.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from tokenspout.config import SpeculativeConfig
from tokenspout.core.request import Request
from tokenspout.engine.messages import SchedulerStats
from tokenspout.models.loader import LoadedModel
from tokenspout.spec_decode.draft_model import (
    DraftProposer,
    draft_block_bytes,
    forward_params,
    load_draft_model,
)
from tokenspout.spec_decode.ngram_proposer import NgramProposer
from tokenspout.spec_decode.policy import SpecPolicy, SpecState, draft_cost
from tokenspout.step_io import ModelRunnerOutput, SchedulerOutput
from tokenspout.structured_output.lazy import LazyStructuredOutputs
from tokenspout.worker.model_runner import ModelRunner

__all__ = ["Speculator", "SpecState", "eligible", "extra_kv_block_bytes", "load_draft"]  # what core/ may use

BlocksOf = Callable[[str], list[int]]  # request id -> its KV block ids (the KV cache manager's)
_Candidate = tuple[Request, list[int] | None, int]  # (request, n-gram drafts or None for the draft model, count)


def load_draft(spec: SpeculativeConfig, target: LoadedModel, quantization: str | None) -> LoadedModel | None:
    """The separate draft model, when the config names one (loaded before the model runner: its KV cache shares
    the target's block count, see `extra_kv_block_bytes`)."""
    if spec.method == "draft" and spec.draft_model:
        return load_draft_model(spec, target, quantization)
    return None


def extra_kv_block_bytes(draft: LoadedModel | None, block_size: int) -> int:
    """KV bytes per block that a separate draft model adds to the target's cache budget."""
    return draft_block_bytes(draft, block_size) if draft is not None else 0


def eligible(req: Request) -> bool:
    """Whether a request may verify drafts: its logits' processing must not depend on its own output tokens (each
    drafted position is processed as if the drafts before it were outputs), and it asks for no logprobs and no
    guidance."""
    return (req.params.logprobs is None and req.companion is None
            and not req.params.depends_on_output(req.num_output_tokens))


class Speculator:
    def __init__(self, spec: SpeculativeConfig, runner: ModelRunner, target: LoadedModel,
                 draft: LoadedModel | None, structured: LazyStructuredOutputs):
        self.spec = spec
        self.structured = structured
        self.proposer = (NgramProposer(spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max)
                         if spec.method == "ngram" else None)
        self.drafter: DraftProposer | None = None
        cost = 0.0
        if spec.method == "draft":
            self.drafter = DraftProposer.build(runner, spec, draft)
            src = self.drafter.source
            cost = draft_cost(forward_params(src.model, src.num_layers), forward_params(target.model, None))
        small = runner.decoder.max_tokens if runner.decoder is not None else 0
        self.policy = SpecPolicy(spec, cost, free_drafts=self.proposer is not None, small_step_tokens=small)
        self._drafts: dict[str, list[int]] = {}
        # Verification rounds so far (SchedulerStats' spec_* counters, for /metrics).
        self.num_drafts = 0  # rounds
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_emitted_tokens = 0  # accepted + 1 per round

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots the scheduler reserves past a sampling request's tokens, for the draft model to write into
        after the step (vLLM's num_lookahead_tokens): n-gram drafts need none."""
        return self.spec.num_speculative_tokens if self.drafter is not None else 0

    def propose_draft_token_ids(self, sched: SchedulerOutput, result: ModelRunnerOutput,
                                running: list[Request], any_waiting: bool, blocks_of: BlocksOf) -> None:
        """After a step (its tokens appended by the scheduler): records the step's verification rounds with the
        policy, then drafts for the next step of every decoding request that speculation may serve and that the
        policy lets draft (`take_draft_token_ids` gives them)."""
        for e in sched.scheduled:
            if e.spec_token_ids and (ids := result.sampled.get(e.request.request_id)):
                self.policy.record(cast(Request, e.request), len(ids))  # tokens emitted: accepted + 1
                self.num_drafts += 1
                self.num_draft_tokens += len(e.spec_token_ids)
                self.num_accepted_tokens += len(ids) - 1
                self.num_emitted_tokens += len(ids)
        if self.drafter is not None:
            for rid in sched.removed_request_ids:
                self.drafter.forget(rid)  # its row (and its draft KV) is gone
        self._drafts = self._propose(running, any_waiting, blocks_of)

    def take_draft_token_ids(self) -> dict[str, list[int]]:
        drafts, self._drafts = self._drafts, {}
        return drafts

    def add_stats(self, stats: SchedulerStats) -> SchedulerStats:
        stats.spec_num_drafts = self.num_drafts
        stats.spec_num_draft_tokens = self.num_draft_tokens
        stats.spec_num_accepted_tokens = self.num_accepted_tokens
        stats.spec_num_emitted_tokens = self.num_emitted_tokens
        return stats

    def _propose(self, running: list[Request], any_waiting: bool, blocks_of: BlocksOf) -> dict[str, list[int]]:
        batched = len(running) > 1
        wanting: list[_Candidate] = []  # (request, n-gram drafts, room)
        rates: dict[int, float] = {}  # tokens per step expected of the requests that may draft (see below)
        grammars = self.structured.manager
        for req in running:
            if req.num_computed_tokens != req.num_tokens - 1 or not eligible(req):
                continue
            room = min(self.spec.num_speculative_tokens, req.max_len - req.num_tokens - 1)
            if room <= 0:
                continue
            if self.proposer is None and req.params.structured_outputs is not None:
                # A draft model's q knows no grammar: cutting its drafts at the first token the grammar refuses
                # (as n-gram drafts are cut below) would bias the rejection sampler, so grammar requests take
                # n-gram drafts only.
                continue
            wants = self.policy.wants_drafts(req, batched)
            if wants:
                rates[id(req)] = max(1.0, self.policy.state(req).ema)
            if self.proposer is not None:
                drafts = self.proposer.propose(req.token_ids)[:room]
                if drafts and req.params.structured_outputs is not None and grammars is not None:
                    # A draft the grammar refuses would be rejected anyway, and so would all after it; the
                    # verify step masks each drafted position by the grammar advanced over the drafts before it.
                    # (Exact for n-gram drafts: q is a point mass, so any way of choosing them is.)
                    drafts = drafts[: grammars.validate_tokens(req.request_id, drafts)]
                if wants and drafts:
                    wanting.append((req, drafts, room))
                elif not wants:
                    self.policy.shadow(req, drafts)  # free evidence for when drafting would pay again
            elif wants:
                wanting.append((req, None, room))
        if batched and not any_waiting:
            keep = self.policy.on_critical_path([r for r, _, _ in wanting], running, rates)
            for (req, found, _), k in zip(wanting, keep):
                if not k and found is not None:
                    self.policy.shadow(req, found)  # not drafting this step: keep the evidence coming
            wanting = [w for w, k in zip(wanting, keep) if k]
        return self._fit(wanting, len(running), blocks_of)

    def _fit(self, wanting: list[_Candidate], num_running: int, blocks_of: BlocksOf) -> dict[str, list[int]]:
        """How many drafts each request gets (the policy's fit to the step), then the draft model's one batched
        run for the requests it drafts for."""
        cands = [(req, drafts, len(drafts) if drafts is not None else self.policy.num_drafts(req, room))
                 for req, drafts, room in wanting]
        for req, drafts, _ in cands:
            if drafts is not None:
                self.policy.state(req).shadow = None  # a real round replaces the pending shadow one
        counts = self.policy.fit_step([(r, n) for r, _, n in cands], num_running)
        out: dict[str, list[int]] = {}
        drafting, num_drafts = [], []
        for (req, drafts, _), n in zip(cands, counts):
            if drafts is not None:
                out[req.request_id] = drafts[:n]
            elif n:
                drafting.append(req)
                num_drafts.append(n)
        if drafting:  # one batched draft-model run for every request that drafts
            assert self.drafter is not None
            for req, drafts in zip(drafting, self.drafter.propose(drafting, num_drafts, blocks_of)):
                out[req.request_id] = drafts
        return out
