"""Request preparation off the event loop.

Rendering a chat template, tokenizing a prompt, validating it and compiling its grammar are synchronous and can be
slow for a hostile (or just large) request: run on the event loop they froze every other stream and /health
(a 20 MB prompt: 24 s; a request template with nested loops: 51 s).  An Offloader runs such a call on its own
worker thread and awaits it, so the loop keeps serving; the calls still hold the GIL while in Python, but CPython
hands it to the loop thread every few milliseconds.

One worker per Offloader: preparation stays serialized as it was on the loop (the tokenizer is shared, and a second
worker would only split the same cores), and the request's context variables (its request id) go with the call.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class Offloader:
    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        ctx = contextvars.copy_context()
        call = functools.partial(ctx.run, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
