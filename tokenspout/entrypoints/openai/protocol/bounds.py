"""Bounds on what one request may list or nest, each a server flag (hostile input: 10^5 guided_choice entries held
the event loop 17 s, 10^4 bad_words 9 s, 10^5 messages 5 s).  Generous for any real use; past one, a 400 that names
the field and the flag.

The request models validate against the bounds of the server handling the request: the body-limit middleware puts
the app's RequestBounds in a context variable for the request's task (limits.BodyLimitMiddleware), and offline /
in-process use of the models sees the defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class RequestBounds:
    json_depth: int = 64  # objects and lists anywhere in the body (a JSON schema 30 levels deep still fits)
    # objects and lists in a body, all together (4096 chat messages of 20 content parts each are ~170k; a million
    # empty lists fit an 8 MiB body and took 1.7 s of the event loop to walk)
    json_containers: int = 1 << 18
    stop: int = 64  # stop strings (OpenAI allows 4)
    token_list: int = 1024  # stop_token_ids, bad_words, logit_bias entries, guided / structured choices
    allowed_token_ids: int = 262144  # the largest vocabularies (Gemma's 256k) listed whole
    messages: int = 4096  # chat messages (also on /tokenize)
    tools: int = 128  # OpenAI's bound
    # a completion's list of prompts: not a flag of its own, the server's fan-out (--max-request-fanout) binds it
    prompts: int = 256

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"request bound {f.name} must be >= 1, got {getattr(self, f.name)}")


# The server flag of each bound (named in the 400).
FLAGS = {"json_depth": "--max-request-json-depth", "json_containers": "--max-request-json-containers",
         "stop": "--max-request-stop",
         "token_list": "--max-request-list-entries", "allowed_token_ids": "--max-request-allowed-token-ids",
         "messages": "--max-request-messages", "tools": "--max-request-tools"}

_CURRENT: ContextVar[RequestBounds] = ContextVar("tokenspout_request_bounds", default=RequestBounds())


def request_bounds() -> RequestBounds:
    """The bounds of the request being parsed (the defaults outside a server)."""
    return _CURRENT.get()


def bind_bounds(bounds: RequestBounds) -> None:
    """Sets the bounds for the rest of this request's task (called by the middleware, once per request)."""
    _CURRENT.set(bounds)


def check_sizes(data: Any, sized: Mapping[str, str], prefix: str = "") -> None:
    """ValueError naming the first field of `data` (a raw request dict) longer than its bound; `sized` maps field
    names to RequestBounds attributes."""
    if not isinstance(data, dict):
        return
    bounds = request_bounds()
    for name, bound in sized.items():
        value = data.get(name)
        limit = getattr(bounds, bound)
        if isinstance(value, (list, dict)) and len(value) > limit:
            raise ValueError(f"{prefix}{name}: at most {limit} entries, got {len(value)} ({FLAGS[bound]})")
