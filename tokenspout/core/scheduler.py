"""Continuous batching with one queue (vLLM v1 style): no prefill/decode phases, just "how many of each request's
known tokens still lack KV", scheduled under a token budget every step.

* Running requests are served first, in arrival order; a long prompt is chunked to fit the budget (chunked prefill)
  and samples nothing until its last chunk.
* When the KV cache has no block for a running request, the newest running request is preempted (its blocks freed,
  its KV recomputed from prompt + output when it resumes at the head of the waiting queue).  No request is lost.
* Waiting requests join while the budget, max_num_seqs and free blocks allow, and none was preempted this step.
  With prefix caching, a joining request (or its resumption after preemption) starts from the longest cached
  block-aligned prefix of its tokens; after each step the blocks filled with final tokens are recorded.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, cast

from tokenspout import guidance
from tokenspout.config import SchedulerConfig
from tokenspout.core.kv_cache_manager import BlockAsk, KVCacheManager
from tokenspout.core.request import Request, RequestStatus
from tokenspout.engine.messages import EngineCoreOutput, PromptLogprobs, RequestTimestamps, SchedulerStats
from tokenspout.step_io import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from tokenspout.structured_output.lazy import LazyStructuredOutputs

if TYPE_CHECKING:
    from tokenspout.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 structured: LazyStructuredOutputs | None = None, num_lookahead_tokens: int = 0):
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._removed: list[str] = []
        self._early_outputs: list[EngineCoreOutput] = []  # requests ended by the scheduler itself
        self._grammar_failures: dict[str, str] = {}  # request id -> why its grammar broke this step (a 400)
        self._first_outputs: list[RequestTimestamps] = []  # requests that got their first token (metrics)
        self.num_preemptions = 0
        # The grammar manager's handle (None: an engine without grammars): a waiting request whose grammar is
        # still compiling is skipped (others go ahead), and grammars are advanced / ended with the tokens.
        self.structured = structured
        # Draft-model speculation: KV slots past a sampling request's new tokens for the draft to write into
        # after the step (vLLM's num_lookahead_tokens); best effort, never a reason to preempt.
        self.num_lookahead_tokens = num_lookahead_tokens

    # ---- requests in and out -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue  # already finished: the abort crossed its last output
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            aborted.append(req)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.companion is not None:
            guidance.release_companion(req.companion, status, self.kv.free, req in self.running, self._removed)
        req.status = status
        if req in self.running:
            self.running.remove(req)
            self._removed.append(req.request_id)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.kv.free(req.request_id)
        self.requests.pop(req.request_id, None)
        grammars = self._grammars()
        if grammars is not None and req.params.structured_outputs is not None:
            grammars.remove(req.request_id)

    def _preempt(self, req: Request) -> None:
        if req.companion is not None:
            guidance.release_companion(req.companion, RequestStatus.PREEMPTED, self.kv.free, True, self._removed)
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        # A step in flight for it returns into nothing (update_from_output skips requests not running); its
        # resumption recomputes from the tokens known then.
        req.num_computed_tokens = req.num_inflight_tokens = req.num_placeholders = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._removed.append(req.request_id)
        self.waiting.appendleft(req)
        logger.debug("preempted %s (KV cache full)", req.request_id)

    def _cannot_fit(self, req: Request) -> None:
        logger.warning("request %s needs more KV blocks than the whole cache holds; ending it", req.request_id)
        self._finish(req, RequestStatus.FINISHED_LENGTH)
        self._early_outputs.append(EngineCoreOutput(req.request_id, [], finish_reason="length"))

    # ---- one step ------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new, comp_new = self._plan(req, budget)
            if num_new + comp_new <= 0:
                i += 1
                continue
            drafts: list[int] = []
            if req.spec_token_ids and num_new == req.num_tokens - req.num_scheduled_tokens == 1:
                drafts = req.spec_token_ids[: budget - 1]
                num_new += len(drafts)
            req.spec_token_ids = []
            lookahead = self._lookahead(req, num_new - len(drafts))
            while not self._allocate(req, num_new, comp_new, lookahead=lookahead):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                if not self.running and req.status is RequestStatus.PREEMPTED and self._alone_too_big(req):
                    # It was alone and the whole cache cannot hold it: it can never grow, so it ends here.
                    self._cannot_fit(req)
                break  # req preempted itself: nothing after it in running can be served either
            scheduled += self._entries(req, num_new, comp_new, drafts)
            budget -= num_new + comp_new
            i += 1

        if not preempted:
            skipped: list[Request] = []
            while self.waiting and budget > 0:
                req = self.waiting[0]
                if self.num_seqs + guidance.num_rows((req,)) > self.config.max_num_seqs:
                    break
                if req.params.structured_outputs is not None:
                    ready = self._grammar_ready(req)
                    if req.status.finished:
                        continue  # its grammar failed: already removed from the queue
                    if not ready:
                        skipped.append(self.waiting.popleft())  # still compiling: do not stall the batch
                        continue
                hits = self._start_from_cache(req)
                num_new, comp_new = self._plan(req, budget)
                if num_new + comp_new <= 0 or (not self.config.enable_chunked_prefill
                                               and num_new < req.num_tokens - req.num_computed_tokens):
                    self._forget_hits(req)
                    break
                if not self._allocate(req, num_new, comp_new, hits, self._lookahead(req, num_new)):
                    self._forget_hits(req)
                    if not self.running and self.kv.num_free_blocks == self.kv.num_blocks:
                        self._cannot_fit(req)
                        continue
                    break
                self._record_hits(req)
                self.waiting.popleft()
                if not req.scheduled_ts:
                    req.scheduled_ts = time.monotonic()
                for seq in guidance.sequences(req):
                    seq.status = RequestStatus.RUNNING
                self.running.append(req)
                scheduled += self._entries(req, num_new, comp_new)
                budget -= num_new + comp_new
            self.waiting.extendleft(reversed(skipped))

        out = SchedulerOutput(scheduled=scheduled, removed_request_ids=self._removed,
                              total_num_tokens=self.config.max_num_batched_tokens - budget)
        self._removed = []
        return out

    @property
    def num_seqs(self) -> int:
        """Sequences holding rows (a guided request and its companion count as two)."""
        return guidance.num_rows(self.running)

    def _plan(self, req: Request, budget: int) -> tuple[int, int]:
        """Tokens to compute this step for the request and for its CFG companion (0 without one)."""
        if req.num_placeholders and req.num_tokens_with_placeholders >= req.max_len:
            return 0, 0  # the token in flight ends it ("length"): nothing more to compute
        rem = req.num_tokens_with_placeholders - req.num_scheduled_tokens
        if req.companion is None:
            return min(rem, budget), 0
        return guidance.plan_pair(req, req.companion, rem, budget)

    def _lookahead(self, req: Request, num_known_new: int) -> int:
        """Lookahead slots for a request whose step reaches its last known token (so it samples)."""
        if (not self.num_lookahead_tokens or req.companion is not None
                or req.num_scheduled_tokens + num_known_new != req.num_tokens):
            return 0
        return self.num_lookahead_tokens

    def _allocate(self, req: Request, num_new: int, comp_new: int, hits: list[list[int]] | None = None,
                  lookahead: int = 0) -> bool:
        """Blocks for this step's tokens of the request and its companion, both or neither; `hits` (from
        _start_from_cache) when they are joining the running set.  `lookahead` more slots for the draft model to
        write into after the step when the cache has them (never a reason to fail)."""
        hits = hits or [[], []]
        total = req.num_scheduled_tokens + num_new
        lookahead = max(0, min(lookahead, req.max_len - total))  # never past the request's length limit

        def asks(extra: int) -> list[BlockAsk]:
            return guidance.pair_block_asks([BlockAsk(req.request_id, total + extra, hits[0])], req, comp_new, hits[1])

        return bool(lookahead and self.kv.allocate_all(asks(lookahead))) or self.kv.allocate_all(asks(0))

    def _start_from_cache(self, req: Request) -> list[list[int]]:
        """For a request about to join the running set (it holds no block and has no KV): its and its
        companion's cached prefix blocks; their computed counts start past them (undone by _forget_hits if the
        request cannot join this step)."""
        hits: list[list[int]] = [[], []]
        for i, seq in enumerate(guidance.sequences(req)):
            if seq.num_computed_tokens:
                raise RuntimeError(f"waiting sequence {seq.request_id} has computed tokens without blocks")
            # Cached positions are not computed, so they could not be scored: a request that still wants prompt
            # logprobs takes no hit (as vLLM).  Its own blocks are still recorded for others.
            hits[i] = [] if seq.wants_prompt_logprobs else self.kv.find_cached(seq)
            seq.num_computed_tokens = len(hits[i]) * self.kv.block_size
        return hits

    @staticmethod
    def _forget_hits(req: Request) -> None:
        for seq in guidance.sequences(req):
            seq.num_computed_tokens = 0

    def _record_hits(self, req: Request) -> None:
        for seq in guidance.sequences(req):
            self.kv.record_lookup(seq.num_tokens, seq.num_computed_tokens)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens

    def _entries(self, req: Request, num_new: int, comp_new: int,
                 drafts: list[int] | None = None) -> list[ScheduledRequest]:
        drafts = drafts or []
        reaches_end = req.num_scheduled_tokens + num_new - len(drafts) == req.num_tokens_with_placeholders
        samples = guidance.pair_samples(req, comp_new, reaches_end)
        entries = [self._entry(req, num_new, samples, drafts)] if num_new else []
        if req.companion is not None and comp_new:
            entries.append(self._entry(req.companion, comp_new, False, []))
        return entries

    def _grammars(self) -> StructuredOutputManager | None:
        """The grammar manager, once the engine's first grammar request made it."""
        return self.structured.manager if self.structured is not None else None

    def _grammar_ready(self, req: Request) -> bool:
        so = self._grammars()
        if so is None or not so.is_ready(req.request_id):
            return False
        err = so.error(req.request_id)
        if err is not None:
            logger.warning("request %s: grammar failed to compile: %s", req.request_id, err)
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            self._early_outputs.append(EngineCoreOutput(req.request_id, [], finish_reason="error", stop_reason=err))
            return False
        return True

    def _alone_too_big(self, req: Request) -> bool:
        return self.kv.blocks_needed(req.request_id, req.num_tokens) > self.kv.num_blocks

    def _entry(self, req: Request, num_new: int, samples: bool, drafts: list[int]) -> ScheduledRequest:
        """The step's entry for req, with its input tokens copied; counts the step as in flight."""
        start = req.num_scheduled_tokens
        end = start + num_new - len(drafts)
        tokens = req.token_ids[start:end]
        placeholder = len(tokens) < end - start
        if end - start - len(tokens) > 1 or (placeholder and drafts):
            raise RuntimeError(f"{req.request_id}: more than one input token unknown (scheduler bug)")
        req.num_inflight_tokens += num_new
        req.num_placeholders += samples
        prompt_lp = None
        if req.wants_prompt_logprobs:
            lo, hi = max(start, req.prompt_lp_next), min(end, req.num_prompt_tokens - 1)
            prompt_lp = (lo, hi) if lo < hi else None
        return ScheduledRequest(req, num_new, samples, drafts, start, tokens, placeholder,
                                self.kv.blocks_of(req.request_id), prompt_lp)

    # ---- after the model ran -------------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs, self._early_outputs = self._early_outputs, []
        for entry in sched.scheduled:
            req = cast(Request, entry.request)  # the runner sees it as a StepSequence; it is our Request
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted, finished or preempted while the step ran: its results are dropped
            req.num_computed_tokens += entry.num_new_tokens
            req.num_inflight_tokens -= entry.num_new_tokens
            req.num_placeholders -= entry.samples
            if req.is_companion:
                self.kv.cache_full_blocks(req)
                continue  # it takes the tokens its guided request samples (below)
            plp = self._take_prompt_logprobs(req, entry, result)
            new_ids = result.sampled.get(req.request_id)
            if not new_ids:
                self.kv.cache_full_blocks(req)  # a prefill chunk
                if plp is not None:
                    outputs.append(EngineCoreOutput(req.request_id, [], prompt_logprobs=plp,
                                                    num_cached_tokens=req.num_cached_tokens))
                continue
            if req.params.max_tokens == 0:
                # Prompt scoring only: the prefill is done and its sampled token is dropped.
                self.kv.cache_full_blocks(req)
                outputs.append(EngineCoreOutput(req.request_id, [], finish_reason=RequestStatus.FINISHED_LENGTH.value,
                                                num_cached_tokens=req.num_cached_tokens, prompt_logprobs=plp))
                self._finish(req, RequestStatus.FINISHED_LENGTH)
                continue
            accepted: list[int] = []
            status = None
            grammar = req.params.structured_outputs is not None and self._grammars() is not None
            for tok in new_ids:
                req.token_ids.append(tok)
                accepted.append(tok)
                status = self._check_stop(req, tok)
                if grammar:
                    # Token by token: a verified run ends where the grammar completes, as plain decoding would.
                    status = self._advance_grammar(req, tok, status)
                if status is not None:
                    break
            if entry.spec_token_ids:
                # KV written for rejected drafts is garbage; the next step overwrites those slots.
                req.num_computed_tokens = req.num_tokens - 1
            # Now num_computed_tokens counts final tokens only (accepted drafts included, rejected ones not), and
            # a finishing request's blocks are recorded before they are freed (beam steps reuse them).
            self.kv.cache_full_blocks(req)
            if status is None:
                guidance.advance_companion(req, accepted)
            lps = result.logprobs.get(req.request_id)
            out = EngineCoreOutput(req.request_id, accepted,
                                   new_logprobs=lps[: len(accepted)] if lps else None,
                                   num_cached_tokens=req.num_cached_tokens, prompt_logprobs=plp)
            if req.num_tokens - len(accepted) == req.num_prompt_tokens:  # its first output: when it queued, ran
                self._first_outputs.append(RequestTimestamps(req.request_id, req.queued_ts, req.scheduled_ts))
            if status is not None:
                out.finish_reason = status.value
                out.stop_reason = req.stop_reason
                if (failure := self._grammar_failures.pop(req.request_id, None)) is not None:
                    out.finish_reason, out.stop_reason = "error", failure  # the frontend raises it (a 400)
                self._finish(req, status)
            outputs.append(out)
        return outputs

    def take_request_timestamps(self) -> list[RequestTimestamps] | None:
        """Timestamps of the requests whose first output was made since the last call (None: none)."""
        if not self._first_outputs:
            return None
        out, self._first_outputs = self._first_outputs, []
        return out
    @staticmethod
    def _take_prompt_logprobs(req: Request, entry: ScheduledRequest, result: ModelRunnerOutput) -> PromptLogprobs | None:
        """The prompt logprobs the step scored for req, advancing what it has been sent."""
        if entry.prompt_lp is None:
            return None
        plp = result.prompt_logprobs.get(req.request_id)
        if plp is None or plp.start != req.prompt_lp_next:
            # (Cannot happen: ranges start where the last one sent ended, and a dropped step sends nothing.)
            logger.error("request %s: prompt logprobs from %s, expected %d (dropped)", req.request_id,
                         None if plp is None else plp.start, req.prompt_lp_next)
            return None
        req.prompt_lp_next = entry.prompt_lp[1]
        return plp

    def _advance_grammar(self, req: Request, tok: int, status: RequestStatus | None) -> RequestStatus | None:
        so = self._grammars()
        assert so is not None  # the request has a grammar
        try:
            accepted = so.accept(req.request_id, (tok,))
        except ValueError as e:  # the request's grammar broke on the token (a limit): reported as its bad input
            logger.warning("request %s: %s", req.request_id, e)
            self._grammar_failures[req.request_id] = str(e)
            return RequestStatus.FINISHED_ABORTED
        if not accepted:
            logger.error("request %s: sampled a token its grammar refuses (engine bug)", req.request_id)
            return status or RequestStatus.FINISHED_ABORTED
        if status is None and so.should_end(req.request_id):
            return RequestStatus.FINISHED_STOPPED  # the grammar is complete: nothing else may follow
        return status

    def update_draft_token_ids(self, drafts: dict[str, list[int]]) -> None:
        """The drafts each running request verifies in its next step (spec_decode/speculator.py); none for the
        requests not named."""
        for req in self.running:
            req.spec_token_ids = drafts.get(req.request_id, [])

    def _check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        if tok in req.stop_ids and req.num_output_tokens > req.params.min_tokens - 1:
            if tok != req.params.eos_token_id:
                req.stop_reason = tok
            return RequestStatus.FINISHED_STOPPED
        if req.num_tokens >= req.max_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def stats(self) -> SchedulerStats:
        return SchedulerStats(num_running=len(self.running), num_waiting=len(self.waiting),
                              kv_cache_usage=self.kv.usage, num_preemptions=self.num_preemptions,
                              num_free_blocks=self.kv.num_free_blocks, num_total_blocks=self.kv.num_blocks,
                              prefix_cache_queries=self.kv.stats.queries,
                              prefix_cache_hits=self.kv.stats.hits)
