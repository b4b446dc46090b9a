"""Fan-in of outputs on the frontend: n > 1 choices (ParentRequest) and per-request async queues
(RequestOutputCollector).  Both merge DELTA outputs the same way (`merge_delta`).

Fan-out: a request with n > 1 becomes n EngineCoreRequests with ids f"{i}_{request_id}".  Child i samples with
n = 1 and its own seed: seed None stays None (the engine draws a random seed per child, so the choices differ);
seed s gives child 0 the seed s (so n = 1 and choice 0 of n > 1 produce the same text) and child i > 0 a 63-bit seed
hashed from (s, i), so distinct children never share a noise stream and (s, i) never collides with (s + 1, i - 1)
the way s + i would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib

from tokenspout.outputs import CompletionOutput, RequestOutput
from tokenspout.sampling_params import RequestOutputKind, SamplingParams


def child_request_id(request_id: str, index: int) -> str:
    return f"{index}_{request_id}"


def child_seed(seed: int | None, index: int) -> int | None:
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def merge_delta(into: CompletionOutput, new: CompletionOutput) -> None:
    """Appends DELTA output `new` to the pending DELTA output `into` for the same choice."""
    into.text += new.text
    into.token_ids = into.token_ids + new.token_ids
    if new.logprobs is not None:
        into.logprobs = (into.logprobs or []) + new.logprobs
    into.cumulative_logprob = new.cumulative_logprob
    into.finish_reason = new.finish_reason
    into.stop_reason = new.stop_reason
    if new.metrics is not None:
        into.metrics = new.metrics


class ParentRequest:
    """Aggregates the n children of one request into the RequestOutputs the user sees.

    CUMULATIVE: every output holds the latest state of each choice that has produced something, ordered by index.
    FINAL_ONLY: one output, once all n choices finished, with all of them.
    DELTA: each output holds only the choices that changed since the previous one, each with its `index`.
    `finished` is True only once all n children finished.
    """

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.n = params.n
        self.output_kind = params.output_kind
        self._latest: dict[int, CompletionOutput] = {}
        self._delta: dict[int, CompletionOutput] = {}
        self._finished: set[int] = set()
        self._changed = False
        self.prompt_logprobs: list | None = None  # child 0's (set by the OutputProcessor)
        self._prompt_logprobs_sent = False

    @property
    def child_request_ids(self) -> list[str]:
        return [child_request_id(self.request_id, i) for i in range(self.n)]

    def child_params(self, index: int) -> SamplingParams:
        # The prompt is the same for every child: only child 0 scores it (unless max_tokens is 0, which needs
        # prompt_logprobs; such requests only score anyway).
        keep = index == 0 or self.params.max_tokens == 0
        return dataclasses.replace(self.params, n=1, seed=child_seed(self.params.seed, index),
                                   prompt_logprobs=self.params.prompt_logprobs if keep else None)

    @property
    def finished(self) -> bool:
        return len(self._finished) == self.n

    def add(self, output: CompletionOutput) -> None:
        """Records one child's new CompletionOutput (shaped by the child's output kind)."""
        if output.finished:
            self._finished.add(output.index)
        if self.output_kind == RequestOutputKind.DELTA:
            pending = self._delta.get(output.index)
            if pending is None:
                self._delta[output.index] = output
            else:
                merge_delta(pending, output)
        else:
            self._latest[output.index] = output
        self._changed = True

    def make_output(self, prompt: str | None, prompt_token_ids: list[int],
                    num_cached_tokens: int = 0) -> RequestOutput | None:
        """The RequestOutput for what changed since the last call, or None when there is nothing to send."""
        if not self._changed:
            return None
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        self._changed = False
        if self.output_kind == RequestOutputKind.DELTA:
            outputs = [self._delta[i] for i in sorted(self._delta)]
            self._delta = {}
        else:
            outputs = [self._latest[i] for i in sorted(self._latest)]
        prompt_logprobs = self.prompt_logprobs
        if self.output_kind == RequestOutputKind.DELTA:
            if self._prompt_logprobs_sent:
                prompt_logprobs = None
            self._prompt_logprobs_sent = self._prompt_logprobs_sent or prompt_logprobs is not None
        return RequestOutput(self.request_id, prompt, prompt_token_ids, outputs, finished=self.finished,
                             num_cached_tokens=num_cached_tokens, prompt_logprobs=prompt_logprobs)


def merge_request_output(into: RequestOutput, new: RequestOutput) -> None:
    """Folds DELTA RequestOutput `new` into the pending one: choices matched by index, new ones inserted in order."""
    by_index = {c.index: c for c in into.outputs}
    for c in new.outputs:
        pending = by_index.get(c.index)
        if pending is None:
            by_index[c.index] = c
        else:
            merge_delta(pending, c)
    into.outputs = [by_index[i] for i in sorted(by_index)]
    into.finished = new.finished
    into.num_cached_tokens = new.num_cached_tokens
    if into.prompt_logprobs is None:
        into.prompt_logprobs = new.prompt_logprobs


class RequestOutputCollector:
    """Single-slot queue between the output loop (producer) and one request's consumer, on one event loop.

    `put` never blocks: if the consumer has not taken the previous output yet, a DELTA output is merged into it and a
    CUMULATIVE / FINAL_ONLY one replaces it (it already holds everything).  An Exception replaces whatever is
    pending and is raised by `get`.
    """

    def __init__(self, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self._output: RequestOutput | Exception | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput | Exception) -> None:
        pending = self._output
        if pending is None or isinstance(output, Exception):
            self._output = output
        elif isinstance(pending, Exception):
            return  # the error wins; the consumer stops at it
        elif self.aggregate:
            merge_request_output(pending, output)
        else:
            self._output = output
        self._ready.set()

    async def get(self) -> RequestOutput:
        while self._output is None:
            await self._ready.wait()
        return self._take()

    def get_nowait(self) -> RequestOutput | None:
        return None if self._output is None else self._take()

    def _take(self) -> RequestOutput:
        output = self._output
        self._output = None
        self._ready.clear()
        if isinstance(output, Exception):
            raise output
        assert output is not None
        return output
