"""The server's ASGI middleware: API-key authentication, CORS and X-Request-Id.

Pure ASGI classes, not Starlette's BaseHTTPMiddleware: that one runs the app in a separate task behind a memory
stream, which hides a client's disconnect from streaming responses (and so leaks the engine request).

Order, outermost first: request id (every response carries X-Request-Id, a 401 too), CORS (a preflight is answered
before authentication, and a 401 still carries the CORS headers so a browser can read it), authentication, the app.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
from collections.abc import Iterable, Sequence

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenspout.entrypoints.anthropic.protocol import auth_error_body, is_anthropic_path
from tokenspout.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, OpenAIServingError
from tokenspout.entrypoints.openai.protocol.common import MAX_REQUEST_ID_CHARS, is_printable_id
from tokenspout.entrypoints.openai.request_ids import REQUEST_ID_HEADER, new_request_id, reset_current, set_current
from tokenspout.entrypoints.openai.sse import send_json_error
from tokenspout.playground import is_page

logger = logging.getLogger(__name__)

# Reachable without a key when --api-key is set (as vLLM's list): probes, scraping, the version and the API docs.
# Every other path needs the key, so a route added later is protected by default.
PUBLIC_PATHS = ("/health", "/ping", "/metrics", "/version", "/docs", "/docs/oauth2-redirect", "/redoc",
                "/openapi.json")


def is_public(path: str) -> bool:
    # Exact or on a segment boundary: /healthcheck is not /health.
    return any(path == p or path.startswith(p + "/") for p in PUBLIC_PATHS)


def _digest(key: bytes) -> bytes:
    # Comparing fixed-size digests keeps the key's length out of the timing too.
    return hashlib.sha256(key).digest()


class APIKeyMiddleware:
    """401 in OpenAI's error shape unless `Authorization: Bearer <one of the keys>` (or HTTP Basic with the key as
    the password, what a browser sends for the playground); OPTIONS (CORS preflight) and PUBLIC_PATHS pass."""

    def __init__(self, app: ASGIApp, api_keys: Sequence[str]) -> None:
        if not api_keys:
            raise ValueError("api_key must hold at least one non-empty key")
        self.app = app
        self._digests = [_digest(k.encode("utf-8")) for k in api_keys]

    def _authorized(self, scope: Scope) -> tuple[bool, str]:
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if header is None:
            # Anthropic's clients send the key as `x-api-key`
            anthropic_key = next((v for k, v in scope["headers"] if k == b"x-api-key"), None)
            if anthropic_key is None:
                return False, "Missing API key: send it in the header 'Authorization: Bearer <key>' (or 'x-api-key')."
            header = b"Bearer " + anthropic_key
        scheme, _, token = header.strip().partition(b" ")
        token = token.strip()
        if scheme.lower() == b"basic" and token:
            # A browser's answer to the playground's Basic challenge: any user name, the key as the password.
            try:
                token = base64.b64decode(token, validate=True).partition(b":")[2]
            except (ValueError, binascii.Error):
                return False, "Malformed Authorization header: Basic credentials are not base64."
        elif scheme.lower() != b"bearer" or not token:
            return False, "Malformed Authorization header: expected 'Bearer <key>'."
        offered = _digest(token)
        match = False
        for d in self._digests:  # no early exit: the time does not tell which key (or whether any) matched
            match |= hmac.compare_digest(offered, d)
        return match, "Incorrect API key provided."

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        if is_public(path):
            await self.app(scope, receive, send)
            return
        ok, message = self._authorized(scope)
        if ok:
            await self.app(scope, receive, send)
            return
        # A browser opening the page is asked for credentials (Basic); API clients are told to send a Bearer key.
        challenge = b'Basic realm="tokenspout", charset="UTF-8"' if is_page(path) else b"Bearer"
        if is_anthropic_path(path):  # Anthropic's clients read their own error shape
            payload = auth_error_body(message)
        else:
            body = ErrorResponse(error=ErrorInfo(message=message, type="AuthenticationError", param=None, code=401))
            payload = body.model_dump_json().encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"www-authenticate", challenge)]})
        await send({"type": "http.response.body", "body": payload})


class RequestIdMiddleware:
    """Echoes the client's X-Request-Id (or a generated one) in every response, and makes it the request's id for
    the serving layer (request_ids.request_ids)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = next((v for k, v in scope["headers"] if k == REQUEST_ID_HEADER.encode()), b"")
        client_id = raw.decode("latin-1").strip()
        if not is_printable_id(client_id):  # echoed in the response and logged
            await send_json_error(send, OpenAIServingError(
                f"X-Request-Id must be at most {MAX_REQUEST_ID_CHARS} printable ASCII characters", param=None))
            return
        value = client_id or new_request_id()
        header = (REQUEST_ID_HEADER.encode(), value.encode("latin-1"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != header[0]]
                message = {**message, "headers": [*headers, header]}
            await send(message)

        token = set_current(value, from_client=bool(client_id))
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            reset_current(token)


def _non_empty(values: Iterable[str] | None) -> list[str]:
    return [v for v in values or () if v]


def install_middleware(app: FastAPI, *, api_key: str | Sequence[str] | None = None,
                       allowed_origins: Sequence[str] | None = None, allowed_methods: Sequence[str] = ("*",),
                       allowed_headers: Sequence[str] = ("*",), allow_credentials: bool = False) -> None:
    """build_app's hook.  `api_key`: one key or several (any one is accepted); None or empty: no authentication.
    `allowed_origins`: None means no CORS middleware at all (browsers then get no cross-origin access)."""
    # Starlette wraps in reverse order of addition: the last added runs first.
    keys = _non_empty([api_key] if isinstance(api_key, str) else api_key)
    if keys:
        app.add_middleware(APIKeyMiddleware, api_keys=keys)
        logger.info("API key authentication is on (%d key%s)", len(keys), "" if len(keys) == 1 else "s")
    if allowed_origins is not None:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=list(allowed_methods),
                           allow_headers=list(allowed_headers), allow_credentials=allow_credentials,
                           expose_headers=["X-Request-Id"])
    app.add_middleware(RequestIdMiddleware)
