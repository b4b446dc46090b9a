"""Request preparation off the event loop.

Rendering a chat template, tokenizing a prompt, validating it and compiling its grammar are synchronous and can be
slow for a hostile (or just large) request: run on the event loop they froze every other stream and /health
(a 20 MB prompt: 24 s; a request template with nested loops: 51 s).  An Offloader runs such a call on its own
worker thread and awaits it, so the loop keeps serving; the calls still hold the GIL while in Python, but CPython
hands it to the loop thread every few milliseconds.

One worker per Offloader: preparation stays serialized as it was on the loop (the tokenizer is shared, and a second
worker would only split the same cores), and the request's context variables (its request id) go with the call.
A call that ran long (a big request) is followed by platform.trim_heap(), so its memory goes back to the system.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tokenspout.platform import trim_heap

T = TypeVar("T")

_TRIM_AFTER_S = 0.2  # calls this long handled a big request: worth a malloc_trim (a few ms) after them


class Offloader:
    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        ctx = contextvars.copy_context()
        call: Callable[[], T] = functools.partial(_timed, ctx.run, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _timed(run: Callable[..., Any], fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    t0 = time.monotonic()
    try:
        return run(fn, *args, **kwargs)
    finally:
        if time.monotonic() - t0 > _TRIM_AFTER_S:
            trim_heap()

