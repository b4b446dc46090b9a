"""What chat and completions serving share: the engine contract, error mapping, merging the output streams of
several prompts, per-request accounting (usage + metrics) and token strings for logprobs."""

from __future__ import annotations

import asyncio
import codecs
import logging
import math
from collections.abc import AsyncGenerator, Callable
from http import HTTPStatus
from typing import Any, Protocol, TypeVar

import anyio

from tokenspout.engine.detokenizer import TokenBytes
from tokenspout.engine.exceptions import EngineDeadError
from tokenspout.entrypoints.openai.protocol import (
    OpenAIServingError,
    PromptLogprob,
    PromptLogprobsJSON,
    PromptTokensDetails,
    UsageInfo,
)
from tokenspout.metrics import FinishedChoice, RequestTimer, ServerMetrics
from tokenspout.offload import Offloader
from tokenspout.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from tokenspout.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# JSON has no -inf; OpenAI-compatible servers send a large negative number instead.
_MIN_LOGPROB = -9999.0
_VALUE_ERROR_FIELDS = {"prompt", "messages", "max_tokens", "logit_bias", "allowed_token_ids", "stop_token_ids",
                       "bad_words", "n", "logprobs", "response_format", "guided_json", "guided_regex", "guided_choice",
                       "guided_grammar", "structured_outputs", "negative_prompt"}


class EngineClient(Protocol):
    """The part of AsyncLLM the server uses (and nothing else)."""

    model_name: str
    max_model_len: int
    tokenizer: Any

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kw: Any) -> str: ...

    def generate(
        self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str, *,
        add_special_tokens: bool | None = None,
    ) -> AsyncGenerator[RequestOutput, None]: ...

    async def abort(self, request_id: str) -> None: ...

    @property
    def errored(self) -> bool: ...

    async def check_health(self) -> None: ...

    def shutdown(self) -> None: ...


def check_model(engine: EngineClient, requested: str | None) -> None:
    if requested is not None and requested != engine.model_name:
        raise OpenAIServingError(
            f"The model `{requested}` does not exist; this server serves `{engine.model_name}`.",
            status=HTTPStatus.NOT_FOUND,
            param="model",
        )


T = TypeVar("T")


async def off_loop(offloader: Offloader | None, build: Callable[[], T]) -> T:
    """build() on the offloader's thread (the server's preparation worker), or here without one.  A response of
    a million logprobs (64 echoed prompts x 1,200 tokens x 20 alternatives, a valid request) is seconds of Python
    to build; on the event loop that froze every stream and /health for as long (1.9 s measured)."""
    return build() if offloader is None else await offloader.run(build)


def to_serving_error(exc: BaseException) -> OpenAIServingError:
    """Maps what the engine raises to the HTTP error the client sees."""
    if isinstance(exc, OpenAIServingError):
        return exc
    if isinstance(exc, EngineDeadError):
        logger.error("engine died during a request: %s", exc)
        return OpenAIServingError(f"The engine is dead: {exc}", status=HTTPStatus.INTERNAL_SERVER_ERROR)
    if isinstance(exc, ValueError):  # bad input found by the engine: prompt too long, id outside the vocabulary
        msg = str(exc) or "invalid request"
        head = msg.split(" ", 1)[0]  # the field, or a dotted path in it ("structured_outputs.regex")
        return OpenAIServingError(msg, param=head if head.split(".", 1)[0] in _VALUE_ERROR_FIELDS else None)
    logger.exception("request failed", exc_info=exc)
    return OpenAIServingError(f"internal server error: {type(exc).__name__}", status=HTTPStatus.INTERNAL_SERVER_ERROR)


async def merge_outputs(
        gens: list[AsyncGenerator[RequestOutput, None]]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Yields (prompt index, output) from several engine generators as outputs arrive.

    Nothing is yielded until every generator has produced its first output (or ended): the engine reports bad
    input at the first output, and any prompt's bad input must fail the whole request before a byte is sent.
    Closing this generator closes every engine generator (so the engine aborts them)."""
    if len(gens) == 1:  # the common case, without tasks
        gen = gens[0]
        try:
            async for out in gen:
                yield 0, out
        finally:
            with anyio.CancelScope(shield=True):
                await gen.aclose()
        return

    queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, gen: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async for out in gen:
                queue.put_nowait((i, out, None))
            queue.put_nowait((i, None, None))
        except Exception as e:  # noqa: BLE001 -- handed to the consumer, which maps it; cancellation is not caught
            queue.put_nowait((i, None, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        pending: list[tuple[int, RequestOutput]] = []
        unprimed, live = set(range(len(gens))), len(gens)
        while live:
            i, got, err = await queue.get()  # got None: generator i ended
            if err is not None:
                raise err
            unprimed.discard(i)
            if got is None:
                live -= 1
            else:
                pending.append((i, got))
            if not unprimed:
                for item in pending:
                    yield item
                pending.clear()
    finally:
        with anyio.CancelScope(shield=True):
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for g in gens:
                await g.aclose()


class ChoiceState:
    """One choice of one prompt, accumulated from the engine's outputs (text only when asked to keep it)."""

    __slots__ = ("finish_reason", "logprobs", "metrics", "num_tokens", "stop_reason", "text_parts", "token_ids")

    def __init__(self) -> None:
        self.text_parts: list[str] = []
        self.token_ids: list[int] = []
        self.num_tokens = 0
        self.logprobs: list[PositionLogprobs] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.metrics: RequestMetrics | None = None  # the engine's timings, on the choice's final output

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class PromptState:
    """Accounting for one engine request (one prompt with its n choices): usage and metrics, ended exactly once."""

    def __init__(self, n: int, kind: RequestOutputKind, metrics: ServerMetrics | None, keep_text: bool) -> None:
        self.choices = [ChoiceState() for _ in range(n)]
        self.kind = kind
        self.keep_text = keep_text
        self.prompt_token_ids: list[int] | None = None
        self.prompt: str | None = None
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.timer = RequestTimer(metrics)

    def observe(self, out: RequestOutput) -> None:
        if self.prompt_token_ids is None:
            self.prompt_token_ids, self.prompt = out.prompt_token_ids, out.prompt
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        any_tokens = False
        for c in out.outputs:
            self._add(self.choices[c.index], c)
            any_tokens = any_tokens or bool(c.token_ids)
        if any_tokens:
            # Only a stream's outputs are timed per token; FINAL_ONLY's single output says nothing about TTFT (its
            # TTFT is the engine frontend's first-token latency, on the final output: see RequestTimer.finish).
            self.timer.on_tokens(timed=self.kind == RequestOutputKind.DELTA)
        if out.finished:
            self.finish("abort")

    def _add(self, st: ChoiceState, c: CompletionOutput) -> None:
        if self.kind == RequestOutputKind.DELTA:
            st.num_tokens += len(c.token_ids)
            if self.keep_text:
                st.text_parts.append(c.text)
                st.token_ids.extend(c.token_ids)
                st.logprobs.extend(c.logprobs or ())
        else:  # CUMULATIVE / FINAL_ONLY carry everything so far
            st.num_tokens = len(c.token_ids)
            if self.keep_text:
                st.text_parts = [c.text]
                st.token_ids = list(c.token_ids)
                st.logprobs = list(c.logprobs or ())
        if c.finish_reason is not None:
            st.finish_reason, st.stop_reason = c.finish_reason, c.stop_reason
        if c.metrics is not None:
            st.metrics = c.metrics

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids or ())

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    def finish(self, default_reason: str) -> None:
        """Records the request in the metrics; choices without a finish reason get `default_reason`."""
        if self.timer.finished:
            return
        done = [FinishedChoice(c.finish_reason or default_reason, c.num_tokens, c.metrics) for c in self.choices]
        self.timer.finish([c.finish_reason for c in done], self.prompt_tokens, self.completion_tokens, done)

    def discard(self) -> None:
        """The engine rejected the request: it never ran, so it is not a finished request."""
        self.timer.finished = True

    def failed(self, exc: BaseException) -> OpenAIServingError:
        """The request failed with `exc`: rejected input (a 4xx) never ran and is discarded, anything else counts
        as a request that ended in error.  Returns the HTTP error to raise or send."""
        err = to_serving_error(exc)
        if err.status < 500:
            self.discard()
        else:
            self.finish("error")
        return err


def usage_of(states: list[PromptState]) -> UsageInfo:
    prompt = sum(s.prompt_tokens for s in states)
    completion = sum(s.completion_tokens for s in states)
    cached = sum(s.num_cached_tokens for s in states)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def special_tokens_kwargs(req: Any) -> dict[str, bool]:
    """vLLM's `add_special_tokens` extra, passed on only when the client set it: otherwise the engine's rule holds
    (the tokenizer's for a plain prompt, none for a rendered chat prompt, whose template wrote them)."""
    return {"add_special_tokens": req.add_special_tokens} if "add_special_tokens" in req.model_fields_set else {}


def safe_logprob(x: float) -> float:
    return _MIN_LOGPROB if math.isnan(x) or x < _MIN_LOGPROB else float(x)


def prompt_logprobs_json(engine: EngineClient, positions: list[PositionLogprobs | None] | None) -> PromptLogprobsJSON | None:
    """vLLM's prompt_logprobs: per prompt token null or {token id: {logprob, rank, decoded_token}}."""
    if positions is None:
        return None
    return [None if pos is None else {
        str(tid): PromptLogprob(logprob=safe_logprob(lp.logprob), rank=lp.rank, decoded_token=token_str(engine, tid, lp))
        for tid, lp in pos.items()} for pos in positions]


class LogprobBytes:
    """Each logprob token's own bytes (engine/detokenizer.py TokenBytes, built at the first use from the engine's
    tokenizer; the bytes of the token's text where there is none)."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine
        self._of: TokenBytes | None = None

    def __call__(self, token_id: int, text: str) -> bytes:
        if self._of is None:
            tokenizer = getattr(self.engine, "tokenizer", None)
            if tokenizer is None:
                return text.encode("utf-8", errors="replace")
            self._of = TokenBytes(tokenizer)
        return self._of(token_id, text)


class TextOffsets:
    """Completions' `text_offset`: the characters of the text before each token, counted on the tokens' bytes with
    an incremental UTF-8 decoder, so the tokens of one split character share its offset.  Adding up each token's
    text alone counted U+FFFD for every part of a split character: the offsets drifted past the text (audit)."""

    def __init__(self, start: int = 0) -> None:
        self.offset = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def take(self, token_bytes: bytes) -> int:
        """The offset of a token of these bytes; moves past its complete characters."""
        at = self.offset
        self.offset += len(self._decoder.decode(token_bytes))
        return at


def token_str(engine: EngineClient, token_id: int, lp: Logprob, as_id: bool = False) -> str:
    """A logprob entry's token text; `as_id` (vLLM's return_tokens_as_token_ids): "token_id:N", which stays exact
    where a token is not valid UTF-8 alone."""
    if as_id:
        return f"token_id:{token_id}"
    if lp.decoded_token is not None:
        return lp.decoded_token
    tok = getattr(engine, "tokenizer", None)
    if tok is not None:
        try:
            return tok.decode([token_id])
        except (ValueError, TypeError, KeyError, IndexError, OverflowError):
            logger.debug("tokenizer cannot decode token id %d alone", token_id)
    return f"token_id:{token_id}"


def prompt_text(engine: EngineClient, prompt: str | list[int], state: PromptState) -> str:
    if isinstance(prompt, str):
        return prompt
    if state.prompt is not None:
        return state.prompt
    return engine.tokenizer.decode(prompt)
