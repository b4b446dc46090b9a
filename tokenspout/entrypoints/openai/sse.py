"""Server-sent events and client-disconnect handling.

`SSEResponse` is a small ASGI response instead of Starlette's StreamingResponse for two reasons:
1. Its HTTP status is decided by the first frame: the engine reports bad input (prompt too long, token id outside
   the vocabulary) only when the request's first output is awaited, and that must still become a 400 JSON error,
   not a 200 stream that carries an error.
2. It always watches for `http.disconnect` and, when the client goes away, cancels the wait on the engine and then
   closes the frame generator explicitly.  uvicorn's `send` silently drops data for a gone client and Starlette
   never closes the body iterator, so without this an abandoned request would keep generating until it finished.

Stream errors after the first frame are sent as `data: {"error": {...}}` followed by `data: [DONE]` (as vLLM does);
the official openai client raises APIError on such a frame.  The same ending is given to a stream still open at the
shutdown deadline (shutdown.Drain): the engine request is aborted, the client gets a 503 error frame and [DONE].
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel
from starlette.responses import Response

from tokenspout.entrypoints.openai.protocol import OpenAIServingError
from tokenspout.entrypoints.openai.protocol.errors import RETRY_AFTER_S
from tokenspout.entrypoints.openai.shutdown import Drain

logger = logging.getLogger(__name__)

T = TypeVar("T")

DONE_FRAME = b"data: [DONE]\n\n"
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # keep reverse proxies from buffering the stream
]


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was complete."""


def shutdown_error() -> OpenAIServingError:
    return OpenAIServingError("The server is shutting down: the request did not finish before the shutdown "
                              "deadline (--shutdown-timeout).", status=503)


def sse_frame(payload: BaseModel) -> bytes:
    return b"data: " + payload.model_dump_json().encode() + b"\n\n"


class ChunkEnvelope:
    """Frames the chunks of one stream.  Every field but `choices` is the same in all of them, so the envelope is
    serialized once (from the model itself, so it cannot drift from the schema) and only the choices per chunk."""

    def __init__(self, template: BaseModel) -> None:
        head, tail = template.model_dump_json().split('"choices":[]', 1)
        self._head = b"data: " + head.encode() + b'"choices":['
        self._tail = b"]" + tail.encode() + b"\n\n"

    def frame(self, *choices: BaseModel) -> bytes:
        return self._head + b",".join(c.model_dump_json().encode() for c in choices) + self._tail


def error_frame(err: OpenAIServingError) -> bytes:
    return sse_frame(err.to_response())


async def send_json_error(send: Any, err: OpenAIServingError,
                          render: Callable[[OpenAIServingError], bytes] | None = None) -> None:
    """`render`: the body in another API's error shape (Anthropic's), else OpenAI's."""
    body = render(err) if render is not None else err.to_response().model_dump_json().encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if err.status == HTTPStatus.SERVICE_UNAVAILABLE:
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _wait_for_disconnect(receive: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse(Response):
    """ASGI response streaming pre-formatted SSE frames (bytes).  An OpenAIServingError raised before the first
    frame becomes a JSON error response with its status; later errors must be turned into frames by the producer.
    (A Starlette Response subclass only so that FastAPI passes it through untouched.)"""

    media_type = "text/event-stream"

    def __init__(self, frames: AsyncIterator[bytes], on_close: Callable[[], None] | None = None,
                 drain: Drain | None = None,
                 render_error: Callable[[OpenAIServingError], bytes] | None = None,
                 end_frame: Callable[[OpenAIServingError], bytes] | None = None) -> None:
        super().__init__(content=None, status_code=200)
        self.frames = frames
        self.on_close = on_close  # called once the stream has ended, however (an admission slot's release)
        self.drain = drain  # the server's shutdown deadline
        self.render_error = render_error  # an error before the first frame in another API's shape
        self.end_frame = end_frame  # the frame that ends a stream cut at the deadline, in another API's shape
        self.client_disconnected = False
        self.cut_at_deadline = False
        self._started = self._ended = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        failure: list[BaseException] = []  # re-raised outside the task group, unwrapped from its ExceptionGroup
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    await _wait_for_disconnect(receive)
                    self.client_disconnected = True
                    logger.debug("client disconnected; cancelling the stream")
                    tg.cancel_scope.cancel()

                async def deadline(drain: Drain) -> None:
                    await drain.wait()
                    self.cut_at_deadline = True
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                if self.drain is not None:
                    tg.start_soon(deadline, self.drain)
                try:
                    await self._stream(send)
                except Exception as e:  # noqa: BLE001 -- re-raised below
                    failure.append(e)
                tg.cancel_scope.cancel()  # the stream is complete: stop watching
        finally:
            # Runs the producer's cleanup (which closes the engine generator, so the engine aborts the request)
            # even when this task is being cancelled.
            with anyio.CancelScope(shield=True):
                await self.frames.aclose()  # type: ignore[attr-defined]
                if self.cut_at_deadline and not self._ended and not self.client_disconnected:
                    await self._end_at_deadline(send)
            if self.on_close is not None:
                self.on_close()
        if failure:
            raise failure[0]

    async def _stream(self, send: Any) -> None:
        try:
            first = await anext(self.frames, None)
        except OpenAIServingError as e:
            await send_json_error(send, e, self.render_error)
            return
        except Exception:
            logger.exception("stream failed before its first frame")
            await send_json_error(send, OpenAIServingError("internal server error", status=500), self.render_error)
            return
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        self._started = True
        if first is not None:
            await send({"type": "http.response.body", "body": first, "more_body": True})
            async for frame in self.frames:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
        self._ended = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _end_at_deadline(self, send: Any) -> None:
        if not self._started:
            await send_json_error(send, shutdown_error(), self.render_error)
            return
        self._ended = True
        err = shutdown_error()
        body = self.end_frame(err) if self.end_frame is not None else error_frame(err) + DONE_FRAME
        await send({"type": "http.response.body", "body": body, "more_body": False})


async def run_until_disconnect(receive: Any, work: Awaitable[T], drain: Drain | None = None) -> T:
    """Awaits `work`, cancelling it if the client disconnects first (which closes the engine generator it is
    iterating, so the engine aborts the request); then raises ClientDisconnected.  At the shutdown deadline
    (`drain`) the work is cancelled the same way and a 503 OpenAIServingError raised."""
    outcome: list[tuple[bool, Any]] = []  # (ok, value or exception), unwrapped from the task group's ExceptionGroup
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            await _wait_for_disconnect(receive)
            tg.cancel_scope.cancel()

        async def deadline(drain: Drain) -> None:
            await drain.wait()
            outcome.append((False, shutdown_error()))
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        if drain is not None:
            tg.start_soon(deadline, drain)
        try:
            outcome.append((True, await work))
        except Exception as e:  # noqa: BLE001 -- re-raised below
            outcome.append((False, e))
        tg.cancel_scope.cancel()
    if not outcome:
        raise ClientDisconnected()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value
