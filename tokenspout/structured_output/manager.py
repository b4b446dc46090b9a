"""StructuredOutputManager: the engine core's per-request grammars, compiled off the step loop.

Lifecycle of a request with `structured_outputs` (the engine core drives it):
  submit()            when the request arrives: compiles in a worker thread (or forks a cached grammar at once)
  is_ready()/error()  the scheduler skips a request whose grammar is still compiling and finishes one whose
                      compile failed, so neither stalls the batch
  grammar_bitmask()   each step, for the rows about to be sampled; None when no row has a grammar
  accept()            with each step's accepted tokens; rollback() to undo tokens (speculative decoding)
  should_end()        the grammar admits nothing more: finish the request with "stop"
  remove()            when the request finishes or is aborted

All methods are called from the engine core's thread; only backend construction and compiles run in the worker.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from tokenspout.sampling_params import StructuredOutputsParams
from tokenspout.structured_output.backend import (
    Grammar,
    GrammarFailed,
    StructuredOutputBackend,
    bitmask_width,
    constraint_field,
    spec_key,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _RequestState:
    future: Future[Grammar]  # the pristine compiled grammar, shared through the cache
    field: str  # the request field it came from, which errors name
    grammar: Grammar | None = None  # this request's own fork, made when the future is first seen done
    error: str | None = None


def _guidance(tokenizer: Any, vocab_size: int, **options: Any) -> StructuredOutputBackend:
    from tokenspout.structured_output.llguidance_backend import GuidanceBackend

    return GuidanceBackend(tokenizer, vocab_size, **options)


# name -> factory(tokenizer, vocab_size, **options); an xgrammar backend registers here.
_BACKENDS: dict[str, Callable[..., StructuredOutputBackend]] = {"guidance": _guidance, "llguidance": _guidance}


class StructuredOutputManager:
    """`tokenizer` is the HF (fast) tokenizer of the model; `vocab_size` the model's logits width (the bitmask has
    ceil(vocab_size / 32) words per row).  The backend is built lazily in the worker thread on the first submit,
    so engines that never see a grammar never pay its ~0.5-1 s tokenizer indexing.  `backend_options` go to the
    backend's constructor (llguidance: eos_token_ids, fill_threads)."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, *, backend: str | StructuredOutputBackend = "guidance",
        max_num_rows: int = 256, max_workers: int = 1, cache_size: int = 256,
        backend_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.width = bitmask_width(vocab_size)
        if isinstance(backend, str):
            if backend not in _BACKENDS:
                raise ValueError(f"structured output backend must be one of {sorted(_BACKENDS)}, got {backend!r}")
            self._backend: StructuredOutputBackend | None = None
            factory, options = _BACKENDS[backend], dict(backend_options or {})
            self._make_backend: Callable[[], StructuredOutputBackend] = lambda: factory(
                tokenizer, vocab_size, **options)
        else:
            self._backend = backend
        self._backend_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        # spec -> future of its pristine grammar.  Futures (not results) are cached so that requests arriving
        # while the same schema is still compiling wait on the one compile instead of starting their own.
        self._cache: OrderedDict[tuple[str, str], Future[Grammar]] = OrderedDict()
        self._cache_size = cache_size
        self._requests: dict[str, _RequestState] = {}
        # Two bitmask buffers used alternately: the tensor handed out for step N may still be in flight to the
        # device (non_blocking copy from pinned memory) while step N+1's mask is being filled.
        self._buffers = [self._alloc(max_num_rows), self._alloc(max_num_rows)]
        self._flip = 0
        self.num_compiles = 0  # compiles actually started (cache misses); tests and metrics read it

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def submit(self, request_id: str, params: StructuredOutputsParams) -> None:
        key = spec_key(params)
        fut = self._cache.get(key)
        if fut is None or (fut.done() and fut.exception() is not None and not isinstance(fut.exception(), ValueError)):
            # A miss, or a cached internal failure worth retrying (invalid specs stay cached: they fail the same).
            fut = self._pool.submit(self._compile, params)
            self.num_compiles += 1
            self._cache[key] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        self._requests[request_id] = _RequestState(fut, constraint_field(params))
        self._resolve(self._requests[request_id])  # a cached grammar is usable this very step

    def is_ready(self, request_id: str) -> bool:
        """True once the compile has finished, successfully or not: check error() before scheduling.  True for
        ids without a grammar, so the scheduler may ask about every request."""
        state = self._requests.get(request_id)
        return state is None or self._resolve(state)

    def error(self, request_id: str) -> str | None:
        """The compile error of a finished compile (the engine finishes the request and reports it), else None."""
        state = self._requests.get(request_id)
        if state is None or not self._resolve(state):
            return None
        return state.error

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def has_grammar(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- per step ------------------------------------------------------------------------------------------------

    def accept(self, request_id: str, token_ids: Sequence[int]) -> bool:
        """Advances the request's grammar over the step's accepted tokens (EOS included).  False, advancing over
        none, if the grammar refuses one: the sampler was given a mask that forbade it, so this is an engine bug
        or a token forced past the mask; the engine should abort the request.  True for ids without a grammar.
        Raises ValueError naming the request's field where the grammar itself broke on them (GrammarFailed: a
        limit of the grammar engine), which the engine reports as the request's bad input."""
        grammar = self._grammar(request_id)
        if grammar is None or not token_ids:
            return True
        try:
            ok = grammar.accept_tokens(token_ids)
        except GrammarFailed as e:
            field = self._requests[request_id].field
            raise ValueError(f"{field} is invalid: {e} (the grammar broke one of its limits while generating)") \
                from None
        if not ok:
            logger.warning("request %s: grammar refused tokens %s", request_id, list(token_ids))
        return ok

    def rollback(self, request_id: str, num_tokens: int) -> None:
        grammar = self._grammar(request_id)
        if grammar is not None:
            grammar.rollback(num_tokens)

    def validate_tokens(self, request_id: str, token_ids: Sequence[int]) -> int:
        """How many of a drafted run the grammar accepts (the engine core trims drafts to this), without advancing."""
        grammar = self._grammar(request_id)
        return len(token_ids) if grammar is None else grammar.validate_tokens(token_ids)

    def should_end(self, request_id: str) -> bool:
        """The grammar is complete and admits no further token: finish the request with "stop"."""
        grammar = self._grammar(request_id)
        return grammar is not None and grammar.is_terminated()

    def grammar_bitmask(
        self, request_ids: Sequence[str | None], draft_token_ids: Mapping[str, Sequence[int]] | None = None,
    ) -> torch.Tensor | None:
        """[len(request_ids), ceil(V/32)] int32 (CPU) masks for one step's rows in order, or None when no row has a
        grammar.  Rows of requests without a grammar (or None) are all ones.

        Speculative decoding: a request owns consecutive rows, one per draft token plus the bonus row, and its
        k-th row (k = 0, 1, ...) is the mask after its first k drafts from `draft_token_ids`.  The grammar is
        advanced over the drafts to fill those rows and rolled back afterwards; rows after a draft the grammar
        refuses are all ones (the rejection sampler rejects that draft, so they are never sampled from).

        The returned tensor is a view of a persistent buffer, valid until the next-but-one call."""
        if not self._requests:
            return None
        items: list[tuple[Grammar, int]] = []
        grammars: list[Grammar | None] = []
        for rid in request_ids:
            grammar = self._grammar(rid, strict=True) if rid is not None and rid in self._requests else None
            grammars.append(grammar)
        if all(g is None for g in grammars):
            return None
        mask = self._buffer(len(request_ids))
        if not draft_token_ids:
            free: list[int] = []
            for row, grammar in enumerate(grammars):
                if grammar is None:
                    free.append(row)
                else:
                    items.append((grammar, row))
            if free:
                # Through numpy: a single-threaded memset.  torch's index_fill_ fans out to intra-op threads, and on
                # a busy host the barrier alone cost ~10 ms here.
                mask.numpy()[free] = -1
            self._backend_or_raise().fill_bitmasks(items, mask)
            return mask
        self._fill_with_drafts(request_ids, grammars, draft_token_ids, mask)
        return mask

    # -- internals -------------------------------------------------------------------------------------------------

    def _fill_with_drafts(
        self, request_ids: Sequence[str | None], grammars: list[Grammar | None],
        drafts: Mapping[str, Sequence[int]], mask: torch.Tensor,
    ) -> None:
        backend = self._backend_or_raise()
        row = 0
        while row < len(request_ids):
            rid, grammar = request_ids[row], grammars[row]
            end = row + 1
            while end < len(request_ids) and request_ids[end] == rid and rid is not None:
                end += 1
            if grammar is None:
                mask.numpy()[row:end] = -1
                row = end
                continue
            draft = list(drafts.get(rid, ())) if rid is not None else []
            advanced = 0
            for k in range(row, end):
                backend.fill_bitmasks([(grammar, k)], mask)
                i = k - row
                if k + 1 == end:
                    break
                if i >= len(draft) or grammar.is_terminated() or not grammar.accept_tokens([draft[i]]):
                    mask.numpy()[k + 1:end] = -1
                    break
                advanced += 1
            grammar.rollback(advanced)
            row = end

    def _compile(self, params: StructuredOutputsParams) -> Grammar:
        return self._backend_or_build().compile(params)

    def build_backend(self) -> None:
        """Builds the grammar backend now (the engine's warm-up) rather than at the first compile."""
        self._backend_or_build()

    def _backend_or_build(self) -> StructuredOutputBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    def _backend_or_raise(self) -> StructuredOutputBackend:
        assert self._backend is not None, "grammar rows exist, so a compile has built the backend"
        return self._backend

    def _resolve(self, state: _RequestState) -> bool:
        """Whether the compile has finished; on first sight of success, forks the request's own grammar."""
        if state.grammar is not None or state.error is not None:
            return True
        if not state.future.done():
            return False
        exc = state.future.exception()
        if exc is None:
            state.grammar = state.future.result().fork()
        elif isinstance(exc, ValueError):
            state.error = str(exc)
        else:
            logger.exception("grammar compile failed", exc_info=exc)
            state.error = f"structured output compile failed: {type(exc).__name__}: {exc}"
        return True

    def _grammar(self, request_id: str, *, strict: bool = False) -> Grammar | None:
        state = self._requests.get(request_id)
        if state is None:
            return None
        if not self._resolve(state) or state.error is not None:
            if strict:  # sampling a row whose grammar does not exist would silently drop the constraint
                raise RuntimeError(f"request {request_id} has no usable grammar (still compiling or failed); "
                                   f"the scheduler must not schedule it")
            return None
        return state.grammar

    def _alloc(self, rows: int) -> torch.Tensor:
        # Pinned on CUDA hosts so the step's host-to-device copy can be non_blocking.
        pin = torch.cuda.is_available()
        return torch.full((rows, self.width), -1, dtype=torch.int32, pin_memory=pin)

    def _buffer(self, rows: int) -> torch.Tensor:
        self._flip ^= 1
        buf = self._buffers[self._flip]
        if buf.shape[0] < rows:  # a bigger batch than planned (e.g. draft rows): grow once, keep it
            buf = self._buffers[self._flip] = self._alloc(max(rows, 2 * buf.shape[0]))
        return buf[:rows]
