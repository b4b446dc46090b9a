"""The replica-picking rule of the Ray Serve deployment (ray_serve.py), kept free of Ray so it is unit-testable.

It is the rule of `--data-parallel-size` (engine/dp_client.py) with Ray Serve replicas for engines, keyed on text
instead of token ids (the ingress does not tokenize; the replica does):
1. prefix affinity: the request's affinity key (below) maps to the replica that last took that key; the request
   goes there unless that replica has more than `min + max(slack, min / 8)` ongoing requests (min: the least loaded
   replica's count), i.e. is busier than the least loaded one by more than a prefill's saving is worth;
2. else the least loaded replica (ties: the replica seen first), and the key is remembered for the replica that
   actually takes the request.
Load is the number of ongoing requests per replica as Ray Serve's router counts them (incremented when it sends a
request, decremented when the request ends, corrected by the replicas' own counts when probed).

The affinity key is the first AFFINITY_CHARS characters of what the prompt starts with: a completion's `prompt`
(text, or its first AFFINITY_TOKENS token ids), a chat's messages as role + content in order.  256 characters are
about 64 tokens, the prefix dp_client hashes: enough to tell system prompts and few-shot preambles apart, short
enough that requests sharing one land on one replica's prefix cache.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Generic, TypeVar

AFFINITY_CHARS = 256
AFFINITY_TOKENS = 64
AFFINITY_SLACK = 2
_AFFINITY_ENTRIES = 4096  # keys remembered (least recently used ones forgotten first)


def _text_of(content: Any) -> str:
    """A message's text: a string, or the text parts of a content list (other parts count as nothing)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def prompt_prefix(body: Mapping[str, Any]) -> str | None:
    """The start of the prompt a request body carries (None: none that can be read, e.g. /v1/models)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        size = 0
        for m in messages:
            if not isinstance(m, dict):
                continue
            part = f"{m.get('role', '')}\x00{_text_of(m.get('content'))}\x00"
            parts.append(part)
            size += len(part)
            if size >= AFFINITY_CHARS:
                break
        return "".join(parts)[:AFFINITY_CHARS] if parts else None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of prompts: its first one decides
    if isinstance(prompt, str):
        return prompt[:AFFINITY_CHARS]
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt[:AFFINITY_TOKENS]):
        return str(prompt[:AFFINITY_TOKENS])
    return None


def affinity_key(body: bytes) -> str | None:
    """The routing key of a raw JSON request body: a short hash of its prompt prefix, or None (unreadable body or
    no prompt: the least loaded replica takes it, and the replica answers the error itself)."""
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    prefix = prompt_prefix(parsed) if isinstance(parsed, dict) else None
    if prefix is None:
        return None
    return hashlib.blake2b(prefix.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


R = TypeVar("R", bound=Hashable)  # a replica's id (Ray Serve's ReplicaID; anything hashable in tests)


class AffinityRule(Generic[R]):
    """The rule of the module docstring over replica ids and their ongoing-request counts."""

    def __init__(self, slack: int = AFFINITY_SLACK, max_entries: int = _AFFINITY_ENTRIES) -> None:
        self.slack = slack
        self.max_entries = max_entries
        self._last: OrderedDict[str, R] = OrderedDict()  # key -> replica that last took it

    def pick(self, key: str | None, loads: Mapping[R, int], order: Sequence[R] | None = None) -> R:
        """The replica for a request with `key`; `loads`: ongoing requests per candidate replica (non-empty);
        `order`: the candidates in tie-break order (default: the mapping's)."""
        candidates = list(order if order is not None else loads)
        least = min(candidates, key=lambda r: loads[r])  # min() keeps the first of equals
        preferred = self._last.get(key) if key is not None else None
        if preferred is None or preferred not in loads:
            return least
        floor = loads[least]
        return least if loads[preferred] > floor + max(self.slack, floor // 8) else preferred

    def ranked(self, key: str | None, loads: Mapping[R, int]) -> list[R]:
        """Every candidate, best first: the pick, then the others by load (the fallbacks if the pick is full)."""
        first = self.pick(key, loads)
        return [first, *sorted((r for r in loads if r != first), key=lambda r: loads[r])]

    def record(self, key: str | None, replica: R) -> None:
        """The replica that took a request with `key` (call once it is sent there)."""
        if key is None:
            return
        self._last[key] = replica
        self._last.move_to_end(key)
        while len(self._last) > self.max_entries:
            self._last.popitem(last=False)

    def forget(self, replica: R) -> None:
        """A replica is gone (died, scaled down): its keys go to whoever is least loaded next."""
        for key in [k for k, r in self._last.items() if r == replica]:
            del self._last[key]
