"""One HTTP request carried from the Ray Serve ingress to a replica, and played there against the replica's own
FastAPI app (build_app's, unchanged) in-process, as ASGI.  No Ray here: the replica and the ingress in ray_serve.py
use it, and a unit test drives it with a fake engine.

The replica answers with a stream: first `(status, headers)`, then the body in chunks.  Chunks that are ready
together are sent as one (under load an SSE stream makes many small frames per engine step; each item crossing the
Ray boundary costs more than its bytes), so the client still sees every frame, only grouped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message
Head = tuple[int, list[tuple[bytes, bytes]]]


@dataclass(slots=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    affinity_key: str | None = None  # ray_routing.affinity_key of the body; read by the request router
    client: tuple[str, int] | None = None


def _scope(req: ForwardedRequest) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": req.method, "scheme": "http", "path": req.path, "raw_path": req.path.encode(),
            "query_string": req.query_string, "root_path": "", "headers": list(req.headers),
            "client": req.client, "server": ("tokenspout-replica", 80), "state": {}}


async def run_asgi(app: ASGIApp, req: ForwardedRequest,
                   extra_headers: Sequence[tuple[bytes, bytes]] = ()) -> AsyncIterator[Head | bytes]:
    """Runs `req` through `app`; yields the head `(status, headers + extra_headers)`, then body chunks.  Closing or
    cancelling the iterator early is a client disconnect for the app (its SSE stream aborts the engine request)."""
    messages: asyncio.Queue[Message | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_read = False

    async def receive() -> Message:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await disconnected.wait()  # the app waits here to learn of a disconnect: only a real one ends the wait
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        messages.put_nowait(message)

    task = asyncio.ensure_future(app(_scope(req), receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    done = False
    try:
        while not done:
            message = await messages.get()
            if message is None:  # the app returned (or raised) before finishing its response
                task.result()  # re-raise its error, if any
                raise RuntimeError("the app ended without a complete response")
            if message["type"] == "http.response.start":
                yield message["status"], [*message.get("headers", []), *extra_headers]
                continue
            if message["type"] != "http.response.body":
                continue
            chunk = bytearray(message.get("body", b""))
            done = not message.get("more_body", False)
            while not done and not messages.empty():  # group what is ready now
                nxt = messages.get_nowait()
                if nxt is None:
                    messages.put_nowait(None)
                    break
                if nxt["type"] == "http.response.body":
                    chunk += nxt.get("body", b"")
                    done = not nxt.get("more_body", False)
            if chunk:
                yield bytes(chunk)
    finally:
        disconnected.set()
        if not done and not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
