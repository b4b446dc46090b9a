"""Per-request state of the OutputProcessor: text, token ids, logprobs, finish reason, what was already sent.

Tokens of one engine step are applied one at a time (decode, then stop-string check), so a stop string is found at
the token that completes it whatever the number of tokens per step (speculative decoding, multi-step): the request
keeps the ids up to and including that token, and the rest of the step is counted as wasted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenspout.engine.detokenizer import IncrementalDetokenizer, TokenTexts
from tokenspout.engine.messages import EngineCoreOutput, EngineCoreRequest, PromptLogprobs, TokenLogprobs
from tokenspout.engine.stop_checker import StopChecker
from tokenspout.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics
from tokenspout.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from tokenspout.engine.parallel_sampling import ParentRequest, RequestOutputCollector


class RequestState:
    def __init__(self, request: EngineCoreRequest, prompt: str | None, tokenizer: Any,
                 token_texts: TokenTexts | None, parent: ParentRequest | None = None, index: int = 0,
                 queue: RequestOutputCollector | None = None) -> None:
        params = request.sampling_params
        self.request_id = request.request_id  # engine id
        self.user_request_id = parent.request_id if parent is not None else request.request_id
        self.parent = parent
        self.index = index
        self.queue = queue
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.arrival_time = request.arrival_time
        self.output_kind = params.output_kind
        self.max_tokens = params.max_tokens
        self.min_tokens = params.min_tokens
        self.stop_token_ids = params.all_stop_token_ids  # EOS (unless ignore_eos) and stop_token_ids
        self.detokenizer: IncrementalDetokenizer | None = None
        if params.detokenize:
            self.detokenizer = IncrementalDetokenizer.from_request(tokenizer, request.prompt_token_ids, params,
                                                                   token_texts=token_texts)
        # The StopChecker is the one owner of include_stop_str_in_output (stop strings and the stop token's text
        # follow the same rule), so there is one whenever there is text, with or without stop strings.
        self.stop_checker: StopChecker | None = None
        if self.detokenizer is not None:
            self.stop_checker = StopChecker(params.stop, params.include_stop_str_in_output)
        want_logprobs = params.logprobs is not None
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[PositionLogprobs] | None = [] if want_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if want_logprobs else None
        # Filled chunk by chunk as the engine scores the prefill; complete before the first token arrives.
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self._prompt_logprobs_sent = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.first_token_time: float | None = None  # frontend clock (time.time()), like arrival_time
        self.last_token_time: float | None = None  # the engine's step timestamp when the caller passes them
        # Engine-core clock: queued, first scheduled (from the first output) and the first token's step timestamp
        # (None when the caller passed no engine timestamp: then the phases are unknown).
        self.queued_ts = 0.0
        self.scheduled_ts = 0.0
        self.first_token_ts: float | None = None
        # DELTA bookkeeping: how much text / how many tokens the consumer has already been given.
        self._sent_text = 0
        self._sent_tokens = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.stop_reason = stop_reason

    def apply(self, out: EngineCoreOutput) -> tuple[int, int]:
        """Applies one engine output; returns (tokens kept, tokens dropped past a stop string)."""
        if out.num_cached_tokens:
            self.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None and self.prompt_logprobs is not None:
            self._add_prompt_logprobs(out.prompt_logprobs)
        ids = out.new_token_ids
        lps = out.new_logprobs
        # The engine ended on a stop token (EOS or stop_token_ids): like vLLM, that token's text is not part of the
        # output unless include_stop_str_in_output; its id still is.
        # (A request can also stop on an ordinary token, e.g. the one completing its grammar: that text stays.)
        skip_last_text = (out.finish_reason == "stop" and self.stop_checker is not None
                          and not self.stop_checker.include_stop_str_in_output and bool(ids)
                          and ids[-1] in self.stop_token_ids)
        last = len(ids) - 1
        for j, tid in enumerate(ids):
            self.token_ids.append(tid)
            if self.logprobs is not None and lps is not None and j < len(lps):
                self._add_logprobs(tid, lps[j])
            if self.detokenizer is None or (skip_last_text and j == last):
                continue
            new = self.detokenizer.step(tid)
            if new and self._append_text(new):
                return j + 1, last - j
        if out.finished:
            if self.detokenizer is not None:
                tail = self.detokenizer.flush()
                if tail:
                    self._append_text(tail)
            assert out.finish_reason is not None
            self.finish(out.finish_reason, out.stop_reason)
        return len(ids), 0

    def _append_text(self, new: str) -> bool:
        """Appends decoded text and checks stop strings; True when one matched (the request is then finished)."""
        start = len(self.text)
        self.text += new
        if self.stop_checker is None or len(self.token_ids) <= self.min_tokens:
            return False
        match = self.stop_checker.find(self.text, start)
        if match is None:
            return False
        self.text = self.text[:self.stop_checker.truncate_to(match)]
        self.finish("stop", match.stop)
        return True

    def _add_logprobs(self, token_id: int, lp: TokenLogprobs) -> None:
        """Sampled token first (with its true rank), then the top-N alternatives ranked 1..N."""
        assert self.logprobs is not None and self.cumulative_logprob is not None
        decode = self.detokenizer.decode_token if self.detokenizer is not None else None
        position: PositionLogprobs = {token_id: Logprob(lp.logprob, lp.rank, decode(token_id) if decode else None)}
        for rank, (tid, value) in enumerate(zip(lp.top_token_ids, lp.top_logprobs), start=1):
            if tid not in position:
                position[tid] = Logprob(value, rank, decode(tid) if decode else None)
        self.logprobs.append(position)
        self.cumulative_logprob += lp.logprob

    def _add_prompt_logprobs(self, plp: PromptLogprobs) -> None:
        """Prompt token start + 1 + j with its logprob and rank first, then its position's top-N ranked 1..N."""
        assert self.prompt_logprobs is not None
        if plp.start != len(self.prompt_logprobs) - 1:
            raise RuntimeError(f"{self.request_id}: prompt logprobs from position {plp.start}, expected "
                               f"{len(self.prompt_logprobs) - 1}")
        decode = self.detokenizer.decode_token if self.detokenizer is not None else None
        n = len(plp.top_token_ids) // len(plp.logprobs) if plp.logprobs else 0
        for j, (value, rank) in enumerate(zip(plp.logprobs, plp.ranks)):
            tid = self.prompt_token_ids[plp.start + 1 + j]
            position: PositionLogprobs = {tid: Logprob(value, rank, decode(tid) if decode else None)}
            for r, (t, v) in enumerate(zip(plp.top_token_ids[j * n : (j + 1) * n],
                                           plp.top_logprobs[j * n : (j + 1) * n]), start=1):
                if t not in position:
                    position[t] = Logprob(v, r, decode(t) if decode else None)
            self.prompt_logprobs.append(position)

    def take_prompt_logprobs(self) -> list[PositionLogprobs | None] | None:
        """The prompt logprobs for an output being emitted: every time, or with DELTA only the first time."""
        if self.output_kind == RequestOutputKind.DELTA:
            if self._prompt_logprobs_sent:
                return None
            self._prompt_logprobs_sent = True
        return self.prompt_logprobs

    def make_completion(self) -> CompletionOutput | None:
        """This choice's output in the request's output kind; None for FINAL_ONLY until finished."""
        finished = self.finished
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        visible = len(self.text)
        if not finished and self.stop_checker is not None:
            visible -= self.stop_checker.holdback(self.text)
        logprobs = self.logprobs
        if self.output_kind == RequestOutputKind.DELTA:
            text = self.text[self._sent_text:visible]
            self._sent_text = max(self._sent_text, visible)
            token_ids = self.token_ids[self._sent_tokens:]
            if logprobs is not None:
                logprobs = logprobs[self._sent_tokens:]
            self._sent_tokens = len(self.token_ids)
        else:
            text = self.text[:visible]
            token_ids = list(self.token_ids)
            if logprobs is not None:
                logprobs = list(logprobs)
        return CompletionOutput(self.index, text, token_ids, self.cumulative_logprob, logprobs,
                                self.finish_reason, self.stop_reason,
                                self.request_metrics() if finished else None)

    def request_metrics(self) -> RequestMetrics:
        """The request's timings so far: each a difference of two times taken on the same clock."""
        m = RequestMetrics(max_tokens_param=self.max_tokens)
        if self.first_token_time is not None and self.arrival_time > 0:
            m.first_token_latency = max(0.0, self.first_token_time - self.arrival_time)
        sched, first, last = self.scheduled_ts, self.first_token_ts, self.last_token_time
        if sched and first is not None and last is not None:
            if self.queued_ts:
                m.queued_time = max(0.0, sched - self.queued_ts)
            m.prefill_time = max(0.0, first - sched)
            m.decode_time = max(0.0, last - first)
            m.inference_time = m.prefill_time + m.decode_time
        return m
