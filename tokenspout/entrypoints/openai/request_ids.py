"""Request ids of the HTTP API: the client's `X-Request-Id` header (or a body `request_id`) becomes the id of the
response and the base of the engine request id, as in vLLM.

The request-id middleware (middleware.py) puts this request's id in a context variable before the route runs, so the
serving layer can name its job without the route passing the HTTP request down.  A client-chosen id may repeat
across concurrent requests while the engine needs unique ids: the engine id then gets a random suffix, and the
response keeps the client's id.
"""

from __future__ import annotations

import secrets
import uuid
from contextvars import ContextVar, Token
from dataclasses import dataclass

REQUEST_ID_HEADER = "x-request-id"


@dataclass(frozen=True, slots=True)
class RequestIdContext:
    value: str
    from_client: bool  # False: generated here, hence unique


_current: ContextVar[RequestIdContext | None] = ContextVar("tokenspout_request_id", default=None)


def new_request_id() -> str:
    return uuid.uuid4().hex


def set_current(value: str, from_client: bool) -> Token:
    return _current.set(RequestIdContext(value, from_client))


def reset_current(token: Token) -> None:
    _current.reset(token)


def current_request_id() -> str | None:
    """The id of the HTTP request being served (the echoed X-Request-Id), None outside a request."""
    ctx = _current.get()
    return ctx.value if ctx is not None else None


def request_ids(prefix: str, explicit: str | None = None) -> tuple[str, str]:
    """(response id, engine request id) for one API request, e.g. ("chatcmpl-abc", "chatcmpl-abc-1f2e3d4c").

    The base is, first found: the client's X-Request-Id header (vLLM lets it win over the body), `explicit` (a body's
    `request_id`), the id the middleware generated for this HTTP request, a fresh uuid.  Only a client-chosen base
    can collide, so only then does the engine id differ from the response id."""
    ctx = _current.get()
    if ctx is not None and ctx.from_client:
        base, unique = ctx.value, False
    elif explicit:
        base, unique = explicit, False
    elif ctx is not None:
        base, unique = ctx.value, True
    else:
        base, unique = new_request_id(), True
    response_id = f"{prefix}-{base}"
    return response_id, response_id if unique else f"{response_id}-{secrets.token_hex(4)}"
