"""Graceful shutdown with a deadline (--shutdown-timeout), and the server's exit on a dead engine.

The first SIGTERM / SIGINT starts draining: uvicorn stops accepting connections, new requests on open connections
get 503, and in-flight requests may finish until the deadline.  At the deadline every stream still open ends with an
error frame and `data: [DONE]` (a non-streamed request gets a 503), so clients see a clean end rather than a cut
connection; then the engine is shut down and the process exits.  A second signal exits at once: the engine
processes are killed (no orphans, their IPC folders removed) and the process ends with 128 + the signal's number.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


class Drain:
    """The shutdown deadline, shared by the server and every response it is streaming.  Waiters may live on any
    event loop (a test client runs one per request): each loop gets its own event, all set at the deadline."""

    def __init__(self) -> None:
        self.draining = False
        self._expired = False
        self._events: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Event] = \
            weakref.WeakKeyDictionary()

    def begin(self, timeout_s: float, loop: asyncio.AbstractEventLoop) -> None:
        """Starts draining; the deadline passes `timeout_s` from now.  Safe from a signal handler."""
        if self.draining:
            return
        self.draining = True
        loop.call_soon_threadsafe(loop.call_later, max(0.0, timeout_s), self.expire_now)

    def expire_now(self) -> None:
        """The deadline has passed (or the server must stop at once): every waiter wakes."""
        self.draining = self._expired = True
        for loop, event in list(self._events.items()):
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that loop is closed: nobody waits there any more
                pass

    @property
    def expired(self) -> bool:
        return self._expired

    async def wait(self) -> None:
        if self._expired:
            return
        loop = asyncio.get_running_loop()
        event = self._events.get(loop)
        if event is None:
            event = self._events[loop] = asyncio.Event()
        await event.wait()


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the two-signal shutdown of the module docstring.  `on_kill()` runs on the second
    signal before the process exits (it kills the engine processes)."""

    def __init__(self, config: uvicorn.Config, drain: Drain, timeout_s: float, on_kill: Callable[[], None]) -> None:
        super().__init__(config)
        self.drain = drain
        self.timeout_s = timeout_s
        self.on_kill = on_kill
        self.exit_code = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit or self.drain.draining:
            logger.warning("second %s: exiting now", signal.Signals(sig).name)
            try:
                self.on_kill()
            finally:
                os._exit(128 + sig)
        logger.info("%s: draining, in-flight requests have %.0f s to finish", signal.Signals(sig).name,
                    self.timeout_s)
        self.drain.begin(self.timeout_s, asyncio.get_event_loop())
        super().handle_exit(sig, frame)

    def fail(self, reason: str) -> None:
        """The engine is dead for good (--no-engine-restart): stop serving and exit non-zero."""
        logger.error("exiting: %s", reason)
        self.exit_code = 1
        self.drain.expire_now()
        self.should_exit = True


def graceful_config(app: Any, host: str, port: int, timeout_s: float, **kw: Any) -> uvicorn.Config:
    """uvicorn's config with its own last resort a little after our deadline (it cancels what is still running)."""
    return uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=max(1, int(timeout_s) + 2), **kw)
