"""OutputProcessor: the one loop over engine outputs on the frontend.

For every EngineCoreOutput it detokenizes the new ids, looks for stop strings, converts logprobs, finishes the
request when the engine (EOS, stop token, length, abort) or a stop string says so, and hands a RequestOutput to the
request's queue (AsyncLLM) or returns it (LLM).

Invariant 7, every request ends exactly once: a request leaves `_states` in `_finish`, the only place a finish reason
is set.  Output that arrives later for an id it no longer knows (the engine had not yet seen the abort sent for a stop
string, or a client disconnect) is dropped and its tokens are counted as wasted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from tokenspout.engine.detokenizer import TokenTexts
from tokenspout.engine.exceptions import EngineDeadError
from tokenspout.engine.messages import EngineCoreOutput, EngineCoreRequest, RequestTimestamps
from tokenspout.engine.parallel_sampling import ParentRequest, RequestOutputCollector
from tokenspout.engine.request_state import RequestState
from tokenspout.outputs import RequestOutput

if TYPE_CHECKING:
    from tokenspout.engine.processor import ProcessedRequest

logger = logging.getLogger(__name__)

_Touched = dict[str, tuple[ParentRequest, RequestState]]  # user request id -> (parent, a child's state)

__all__ = ["EngineDeadError", "EngineRequestSink", "FrontendStats", "OutputProcessor", "OutputProcessorOutput", "ParentRequest",
           "RequestOutputCollector"]


class EngineRequestSink(Protocol):
    """The one call `add_processed` makes on an engine client (Inproc / SyncMP / AsyncMP / data-parallel)."""

    def add_request(self, req: EngineCoreRequest) -> None: ...


@dataclass(slots=True)
class OutputProcessorOutput:
    request_outputs: list[RequestOutput] = field(default_factory=list)  # only for requests without a queue
    reqs_to_abort: list[str] = field(default_factory=list)  # engine ids finished here by a stop string
    # Tokens of this batch, as vLLM counts an engine step's (iteration_tokens_total): the prompts of requests that
    # got their first output, plus the tokens generated.
    num_tokens: int = 0


@dataclass(slots=True)
class FrontendStats:
    """Counters are totals since start; latency samples (seconds) are those since the last `take_stats()`."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0  # tokens accepted into outputs
    num_wasted_tokens: int = 0  # generated past a stop string, or arrived for a request already finished here
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    ttft_s: list[float] = field(default_factory=list)
    inter_token_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Any, log_stats: bool = True) -> None:
        self.tokenizer = tokenizer
        self.log_stats = log_stats
        self.stats = FrontendStats()
        self._token_texts = TokenTexts(tokenizer) if tokenizer is not None else None
        self._states: dict[str, RequestState] = {}  # engine request id -> state
        self._parents: dict[str, ParentRequest] = {}  # user request id -> parent (n > 1)
        self._children: dict[str, list[str]] = {}  # user request id -> engine ids still running
        # Final outputs produced outside process_outputs (aborts, errors) for requests without a queue.
        self._pending: list[RequestOutput] = []

    # ---- requests in -------------------------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest, prompt: str | None, parent: ParentRequest | None = None,
                    index: int = 0, queue: RequestOutputCollector | None = None) -> None:
        rid = request.request_id
        if rid in self._states:
            raise ValueError(f"request_id {rid!r} is already running")
        if request.sampling_params.detokenize and self.tokenizer is None:
            raise ValueError("detokenize=True needs a tokenizer")
        user_id = parent.request_id if parent is not None else rid
        if user_id in self._children and self._parents.get(user_id) is not parent:
            raise ValueError(f"request_id {user_id!r} is already running")
        state = RequestState(request, prompt, self.tokenizer, self._token_texts, parent, index, queue)
        self._states[rid] = state
        self._children.setdefault(user_id, []).append(rid)
        if parent is not None:
            self._parents[user_id] = parent

    def add_processed(self, processed: ProcessedRequest, client: EngineRequestSink,
                      queue: RequestOutputCollector | None = None) -> list[str]:
        """Registers a processed request here, every child first, then sends the children to the engine: an output
        can then never arrive for an id this side does not know yet.  Returns the engine request ids."""
        for index, req in enumerate(processed.requests):
            self.add_request(req, processed.prompt_text, processed.parent, index, queue)
        for req in processed.requests:
            client.add_request(req)
        return [req.request_id for req in processed.requests]

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def get_num_unfinished_requests(self) -> int:
        return len(self._states)

    # ---- outputs in --------------------------------------------------------------------------------------------

    def process_outputs(self, outputs: Iterable[EngineCoreOutput], engine_timestamp: float | None = None,
                        request_timestamps: Mapping[str, RequestTimestamps] | None = None) -> OutputProcessorOutput:
        """Consumes one batch of engine outputs.  `engine_timestamp` (any clock) times inter-token latency;
        TTFT and end-to-end latency use time.time() against the request's arrival_time.  `request_timestamps`
        (engine id -> when the engine core queued / first scheduled it, on the clock of `engine_timestamp`) feed
        the requests' queue / prefill / decode / inference times."""
        result = OutputProcessorOutput(request_outputs=self._pending)
        self._pending = []
        now = time.time()
        step_time = now if engine_timestamp is None else engine_timestamp
        touched: _Touched = {}
        for out in outputs:
            state = self._states.get(out.request_id)
            if state is None:
                self.stats.num_wasted_tokens += len(out.new_token_ids)
                continue
            if out.finish_reason == "error" and isinstance(out.stop_reason, str) and state.queue is not None:
                self.propagate_error(out.stop_reason, {out.request_id}, ValueError)  # bad input the engine found
                continue
            if state.first_token_time is None and (out.new_token_ids or out.finished):
                self.stats.num_prompt_tokens += len(state.prompt_token_ids)
                result.num_tokens += len(state.prompt_token_ids)
            result.num_tokens += len(out.new_token_ids)
            if request_timestamps is not None and (ts := request_timestamps.get(out.request_id)) is not None:
                state.queued_ts, state.scheduled_ts = ts.queued_ts, ts.scheduled_ts
            self._record_latency(state, out, now, step_time, engine_timestamp)
            kept, wasted = state.apply(out)
            self.stats.num_generation_tokens += kept
            self.stats.num_wasted_tokens += wasted
            if state.finished:
                if not out.finished:
                    result.reqs_to_abort.append(out.request_id)  # the engine does not know yet
                self._finish(state, now)
            if not (out.new_token_ids or state.finished):
                continue
            self._emit(state, result.request_outputs, touched)
        self._emit_parents(touched, result.request_outputs)
        return result

    def _record_latency(self, state: RequestState, out: EngineCoreOutput, now: float, step_time: float,
                        engine_timestamp: float | None) -> None:
        if not out.new_token_ids:
            return
        if state.first_token_time is None:
            state.first_token_time = now
            state.first_token_ts = engine_timestamp
            if self.log_stats and state.arrival_time > 0:
                self.stats.ttft_s.append(max(0.0, now - state.arrival_time))
        elif self.log_stats and state.last_token_time is not None:
            self.stats.inter_token_s.append(max(0.0, step_time - state.last_token_time))
        state.last_token_time = step_time

    # ---- finishing ---------------------------------------------------------------------------------------------

    def _finish(self, state: RequestState, now: float) -> None:
        """Removes a finished request; the single exit every request goes through once."""
        del self._states[state.request_id]
        user_id = state.user_request_id
        children = self._children.get(user_id)
        if children is not None:
            children.remove(state.request_id)
            if not children:
                del self._children[user_id]
                self._parents.pop(user_id, None)
        reason = state.finish_reason or "unknown"
        self.stats.finished_by_reason[reason] = self.stats.finished_by_reason.get(reason, 0) + 1
        if self.log_stats and state.arrival_time > 0:
            self.stats.e2e_s.append(max(0.0, now - state.arrival_time))

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Frontend-side cancel (client disconnect, LLM abort).  Accepts user ids (a parent's id covers all its
        children) and engine ids; finishes each running one with finish_reason "abort" and returns the engine ids
        the caller must abort in the engine core.  Final outputs go to the request's queue, or to the next
        `process_outputs` result for requests without one."""
        engine_ids: list[str] = []
        for rid in request_ids:
            if rid in self._children:
                engine_ids.extend(self._children[rid])
            elif rid in self._states:
                engine_ids.append(rid)
        now = time.time()
        touched: _Touched = {}
        for eid in dict.fromkeys(engine_ids):
            state = self._states[eid]
            state.finish("abort")
            self._finish(state, now)
            self._emit(state, self._pending, touched)
        self._emit_parents(touched, self._pending)
        return list(dict.fromkeys(engine_ids))

    def propagate_error(self, message: str, request_ids: set[str] | None = None,
                        error: type[Exception] = EngineDeadError) -> None:
        """The engine core died: every in-flight request (or those of `request_ids`, the engine requests of one
        data-parallel engine that died) ends with finish_reason "error".  Queues get an `error(message)` (raised to
        the consumer: EngineDeadError, or ValueError for bad input the engine found); requests without a queue get
        a final output."""
        now = time.time()
        touched: _Touched = {}
        queues: dict[int, RequestOutputCollector] = {}
        for state in list(self._states.values()):
            if request_ids is not None and state.request_id not in request_ids:
                continue
            state.finish("error")
            self._finish(state, now)
            if state.queue is not None:
                queues[id(state.queue)] = state.queue
            else:
                self._emit(state, self._pending, touched)
        self._emit_parents(touched, self._pending)
        for q in queues.values():
            q.put(error(message))
        if (queues or touched) and error is EngineDeadError:
            logger.error("engine error, failed %d request queue(s): %s", len(queues), message)

    # ---- outputs out -------------------------------------------------------------------------------------------

    def _emit(self, state: RequestState, sink: list[RequestOutput], touched: _Touched) -> None:
        completion = state.make_completion()
        if completion is None:
            return
        if state.parent is not None:
            # Children are folded into one RequestOutput per parent per batch (see _emit_parents); the prompt is
            # scored by child 0 only (see ParentRequest.child_params).
            if state.index == 0 and state.prompt_logprobs is not None:
                state.parent.prompt_logprobs = state.prompt_logprobs
            state.parent.add(completion)
            touched[state.user_request_id] = (state.parent, state)
            return
        out = RequestOutput(state.user_request_id, state.prompt, state.prompt_token_ids, [completion],
                            finished=state.finished, num_cached_tokens=state.num_cached_tokens,
                            prompt_logprobs=state.take_prompt_logprobs())
        self._deliver(state.queue, out, sink)

    def _emit_parents(self, touched: _Touched, sink: list[RequestOutput]) -> None:
        # All children share the prompt and the queue, so any child's state can address the parent's output.
        for parent, state in touched.values():
            out = parent.make_output(state.prompt, state.prompt_token_ids, state.num_cached_tokens)
            if out is not None:
                self._deliver(state.queue, out, sink)

    @staticmethod
    def _deliver(queue: RequestOutputCollector | None, out: RequestOutput, sink: list[RequestOutput]) -> None:
        if queue is not None:
            queue.put(out)
        else:
            sink.append(out)

    # ---- stats -------------------------------------------------------------------------------------------------

    def take_stats(self) -> FrontendStats:
        """A snapshot of the counters plus the latency samples since the previous call (which are then cleared)."""
        s = self.stats
        snap = FrontendStats(s.num_prompt_tokens, s.num_generation_tokens, s.num_wasted_tokens,
                             dict(s.finished_by_reason), s.ttft_s, s.inter_token_s, s.e2e_s)
        s.ttft_s, s.inter_token_s, s.e2e_s = [], [], []
        return snap
