"""Bounds on what one HTTP request, or all of them together, may ask of the server (hostile input).

* Body size: a body over `max_body_bytes` is a 413 -- at once when its Content-Length says so, else as soon as the
  bytes read pass the limit (a chunked body), before any of it is parsed.  A 20 MB prompt otherwise held the event
  loop for ~24 s and grew the server by 1.3 GB.
* Fan-out: one /v1/completions request starts prompts x n engine requests; more than `max_fanout` is a 400
  (`prompt: ["hi"] * 2000, n: 128` in a 40 KB body asked for 256,000).
* Admission: engine requests in flight (every admitted API request counts its fan-out until its response ends or
  its client goes away) may exceed what the engines run at once (`running_capacity`: --max-num-seqs x engines) by
  at most `max_queued_requests`; past that a new request is a 503 with Retry-After at once, instead of joining a
  queue whose wait no client would sit out.
Each limit is a `serve` flag (README, "Operating tokenspout"); the errors are in OpenAI's shape and name the flag.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenspout.entrypoints.anthropic.protocol import error_body as anthropic_error_body
from tokenspout.entrypoints.anthropic.protocol import is_anthropic_path
from tokenspout.entrypoints.openai.protocol import OpenAIServingError
from tokenspout.entrypoints.openai.protocol.bounds import RequestBounds, bind_bounds
from tokenspout.entrypoints.openai.protocol.errors import RETRY_AFTER_S
from tokenspout.entrypoints.openai.sse import send_json_error

DEFAULT_MAX_BODY_BYTES = 8 << 20  # a 128k-token prompt is ~0.5-1 MB of JSON
DEFAULT_MAX_FANOUT = 256  # two prompts at OpenAI's largest n (128)
DEFAULT_MAX_QUEUED_REQUESTS = 1024
DEFAULT_MAX_HEADER_BYTES = 32 << 10  # nginx's default header buffers (4 x 8 KiB); real clients send < 2 KiB


@dataclass(frozen=True, slots=True)
class ServerLimits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_fanout: int = DEFAULT_MAX_FANOUT
    max_queued_requests: int | None = DEFAULT_MAX_QUEUED_REQUESTS  # None: no admission control
    running_capacity: int = 64  # engine requests the engines run at once (--max-num-seqs x engines)
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES  # names + values of all request headers together
    bounds: RequestBounds = RequestBounds()  # list sizes and JSON nesting inside a request (protocol/bounds.py)

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_fanout", "running_capacity", "max_header_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")


def _too_large(limit: int) -> str:
    return f"Request body too large: the limit is {limit} bytes (--max-request-body-bytes)."


class BodyTooLarge(StarletteHTTPException):
    """Raised from the body's receive channel; FastAPI re-raises HTTPExceptions met while reading a body, and the
    app's handler answers it in OpenAI's shape."""

    def __init__(self, limit: int) -> None:
        super().__init__(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, _too_large(limit))


# The routes that start engine requests (each charges the admission gate).
GENERATION_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                               "/invocations"})


def _route(scope: Scope) -> str:
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class BodyLimitMiddleware:
    """The outermost middleware: request headers at most `max_header_bytes` together (431), the body at most
    `max_bytes` (413), a generation request while the admission queue is full (503), all refused before the app
    parses the request; and the request's task gets the server's RequestBounds, which the request models validate
    against."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
                 bounds: RequestBounds = RequestBounds()) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_header_bytes = max_header_bytes
        self.bounds = bounds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        bind_bounds(self.bounds)
        header_bytes = sum(len(k) + len(v) for k, v in scope["headers"])
        if header_bytes > self.max_header_bytes:
            await send_json_error(send, OpenAIServingError(
                f"Request headers too large: {header_bytes} bytes, the limit is {self.max_header_bytes} "
                f"(--max-request-header-bytes).", status=HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE))
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        # Anthropic's routes answer in Anthropic's error shape (its clients parse that one)
        render = anthropic_error_body if is_anthropic_path(scope["path"]) else None
        if declared is not None and not declared.isdigit():
            await send_json_error(send, OpenAIServingError("Content-Length is not a number"), render)
            return
        if declared is not None and int(declared) > self.max_bytes:  # answered without reading the body
            await send_json_error(send, OpenAIServingError(_too_large(self.max_bytes),
                                                           status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE), render)
            return
        if scope["method"] == "POST" and _route(scope) in GENERATION_ROUTES:
            server = getattr(scope["app"].state, "server", None)  # the app's ServerState (api_server.py)
            if server is not None and server.gate.saturated:
                # The queue is full: any generation request would be refused after its body was parsed and
                # validated; refusing it here keeps a storm's 503s within milliseconds (bench.chaos).
                await send_json_error(send, ServerBusy(server.gate.limits, server.gate.in_flight), render)
                return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counted, send)


class ServerBusy(OpenAIServingError):
    def __init__(self, limits: ServerLimits, in_flight: int) -> None:
        super().__init__(f"The server is busy: {in_flight} requests are running or queued (at most "
                         f"{limits.running_capacity} run at once and {limits.max_queued_requests} may wait, "
                         f"--max-queued-requests); retry later.", status=HTTPStatus.SERVICE_UNAVAILABLE)


class AdmissionGate:
    """Counts the engine requests of admitted API requests; all calls come from the event loop (no lock)."""

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self.in_flight = 0

    @property
    def saturated(self) -> bool:
        """Every request would be refused now (admit() of one more engine request raises ServerBusy)."""
        lim = self.limits
        return lim.max_queued_requests is not None and self.in_flight >= lim.running_capacity + lim.max_queued_requests

    def admit(self, count: int) -> Callable[[], None]:
        """Admits one API request's `count` engine requests (prompts x n) or raises: a 400 past the fan-out limit,
        ServerBusy past the queue.  Returns the release (idempotent).  A request larger than the whole capacity (a
        fan-out the limits allow) is admitted when nothing else is in flight, so it can always run, alone."""
        lim = self.limits
        if count > lim.max_fanout:
            raise OpenAIServingError(
                f"This request asks for {count} completions (prompts x n); the server allows at most "
                f"{lim.max_fanout} per request (--max-request-fanout).", param="n")
        if lim.max_queued_requests is not None and self.in_flight and \
                self.in_flight + count > lim.running_capacity + lim.max_queued_requests:
            raise ServerBusy(lim, self.in_flight)
        self.in_flight += count
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.in_flight -= count

        return release
