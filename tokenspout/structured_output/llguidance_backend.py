"""The llguidance grammar backend.

llguidance compiles JSON schemas, regexes, Lark (and GBNF) grammars into an Earley parser over a lazily built
lexer, and computes a token mask in ~10-30 us per row in the common case (a few hundred at the start of an
open-ended string); its LLMatcher keeps the token history, so rollback is cheap and a drafted run can be checked
without advancing.  Strings must be raw UTF-8: llguidance's default refuses general \\uXXXX escapes.

JSON whitespace: by default we compile schemas with `whitespace_flexible: false`, so objects come out compact
(`{"a":1,"b":[2,3]}`, separators "," and ":").  Flexible whitespace lets a small model wander into runs of
newlines and spaces that burn max_tokens and never close the object; compact output is what most clients parse
anyway.  A schema may override this per request through llguidance's own `"x-guidance"` key (we pass ours as
defaults, which `x-guidance` overrides), e.g. `{"x-guidance": {"whitespace_flexible": true}, ...}`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import numpy as np

from tokenspout.sampling_params import StructuredOutputsParams
from tokenspout.structured_output.backend import (
    Grammar,
    GrammarFailed,
    StructuredOutputBackend,
    bitmask_width,
    constraint_field,
    lark_regex_escape,
)

if TYPE_CHECKING:
    import torch
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stubs only (absent at run time)

logger = logging.getLogger(__name__)

JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}
_MAX_MESSAGE = 600  # llguidance errors can quote a whole grammar; an HTTP 400 body needs the first lines
# Without verbose errors llguidance leaves the parser state and grammar out of messages (they can be long and
# would echo the user's schema into logs).
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
# Below this many grammar rows the thread hand-off of the parallel fill costs more than it saves.
_PAR_FILL_MIN_ROWS = 4


def _check(bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    import torch  # here, not at module level: the API server imports this module (validate) and never torch

    # llguidance writes through a raw pointer (we skip llguidance.torch: importing it pulls in torch.compile,
    # ~2 s), so the layout and bounds checks are ours to make; llguidance itself checks the row width.
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or not bitmask.is_cpu or not bitmask.is_contiguous():
        raise ValueError("grammar bitmask must be a contiguous 2-D int32 CPU tensor")
    if any(not 0 <= r < bitmask.shape[0] for r in rows):
        raise IndexError(f"bitmask row out of range [0, {bitmask.shape[0]})")


def _invalid(params: StructuredOutputsParams, message: str) -> ValueError:
    message = message.strip()
    if len(message) > _MAX_MESSAGE:
        message = message[:_MAX_MESSAGE] + " ..."
    return ValueError(f"{constraint_field(params)} is invalid: {message}")


def grammar_spec(params: StructuredOutputsParams) -> str:
    """The llguidance grammar text for a request (not yet checked beyond what parsing the spec itself finds)."""
    spec = _answer_spec(params)
    if params.reasoning_end is None:
        return spec
    return after_reasoning(spec, params.reasoning_end, params.reasoning_start)


def after_reasoning(spec: str, end_marker: str, start_marker: str | None = None) -> str:
    """`spec` applied only after the reasoning: free text up to and including the first `end_marker` (a lazy
    lexeme), whitespace, then the answer's grammar as a named subgrammar.  `start_marker`: the reasoning is
    optional, opened by it; a reply that does not open with it is the answer from its first token (vLLM-test
    finding: with qwen3 a reply without `<think>` was never constrained)."""
    top = json.loads(spec) if spec.lstrip().startswith("{") else {"grammars": [{"lark_grammar": spec}]}
    grammars = top["grammars"]
    grammars[0] = {**grammars[0], "name": "answer"}
    marker = lark_regex_escape(end_marker)
    if start_marker is None:
        lark = ("start: reasoning /[ \\t\\r\\n]*/ @answer\n"
                f"reasoning[lazy]: /(?s:.*){marker}/\n")
    else:
        lark = (f"start: {json.dumps(start_marker)} reasoning /[ \\t\\r\\n]*/ @answer | @answer\n"
                f"reasoning[lazy]: /(?s:.*){marker}/\n")
    return json.dumps({**top, "grammars": [{"lark_grammar": lark}, *grammars]})


def _answer_spec(params: StructuredOutputsParams) -> str:
    if params.json is not None:
        try:
            schema = json.loads(params.json)
        except json.JSONDecodeError as e:
            raise _invalid(params, f"not valid JSON ({e})") from None
        if not isinstance(schema, dict):
            raise _invalid(params, f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    if params.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if params.regex is not None:
        # llguidance drops a lone trailing backslash (so "a\\" would mean "a"): an unfinished escape is an error
        if (len(params.regex) - len(params.regex.rstrip("\\"))) % 2:
            raise _invalid(params, "the regex ends in an unfinished escape (a lone trailing backslash)")
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        # Lark string literals take JSON escapes, so json.dumps quotes any choice (quotes, backslashes, unicode).
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    assert params.grammar is not None
    try:
        # "grammar" accepts Lark as is and converts GBNF (llama.cpp's syntax) to Lark first.
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as e:
        raise _invalid(params, str(e)) from None


def validate(params: StructuredOutputsParams) -> None:
    """Cheap synchronous check for the API server (well under a millisecond for typical schemas): ValueError
    naming the problem, which the server maps to HTTP 400.  Needs no tokenizer, so a grammar that only fails
    against the vocabulary still surfaces later, as a compile error in the engine."""
    spec = grammar_spec(params)
    err = llguidance.LLMatcher.validate_grammar(spec, limits=_LIMITS)
    if err:
        raise _invalid(params, err)


class GuidanceGrammar(Grammar):
    """An LLMatcher plus the EOS bookkeeping it lacks: once a grammar stops on its own (e.g. the object's closing
    brace, "NoExtension"), the mask allows only EOS, yet llguidance's list APIs (try_consume_tokens,
    validate_tokens) refuse that EOS.  We accept it here without feeding it to the matcher and count it, so a later
    rollback undoes those EOS tokens first."""

    __slots__ = ("_eos", "_eos_after_stop", "_m")

    def __init__(self, matcher: llguidance.LLMatcher, eos_ids: frozenset[int], eos_after_stop: int = 0) -> None:
        """eos_after_stop: EOS tokens accepted past the grammar's stop so far (a fork carries its origin's)."""
        self._m = matcher
        self._eos = eos_ids
        self._eos_after_stop = eos_after_stop

    def _trailing_eos(self, ids: list[int], start: int) -> int:
        n = start
        while n < len(ids) and ids[n] in self._eos:
            n += 1
        return n

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        ids = list(token_ids)
        if not ids:
            return True
        # try_consume_tokens stops at the first refused token without entering llguidance's sticky error state,
        # so a refusal can be undone and the grammar stays usable.
        n = self._m.try_consume_tokens(ids)
        if n < len(ids) and self._m.is_stopped() and not self._m.is_error():
            end = self._trailing_eos(ids, n)
            self._eos_after_stop += end - n
            n = end
        if n == len(ids):
            return True
        if self._m.is_error():  # not a refusal: the matcher broke (its state cannot be rolled back)
            raise GrammarFailed(self._m.get_error().split("\n", 1)[0].strip())  # (its first line says it)
        self.rollback(n)
        logger.debug("grammar refused token %d at offset %d", ids[n], n)
        return False

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        ids = list(token_ids)
        n = self._m.validate_tokens(ids)
        if n == len(ids) or ids[n] not in self._eos:
            return n
        # EOS refused: fine if the matcher is stopped after the first n tokens (advance, look, undo).
        consumed = self._m.try_consume_tokens(ids[:n]) if n else 0
        stopped = self._m.is_stopped()
        if consumed:
            self._m.rollback(consumed)
        return self._trailing_eos(ids, n) if stopped and consumed == n else n

    def rollback(self, num_tokens: int) -> None:
        phantom = min(num_tokens, self._eos_after_stop)
        self._eos_after_stop -= phantom
        num_tokens -= phantom
        if num_tokens > 0 and not self._m.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback of {num_tokens} tokens failed: {self._m.get_error()}")

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        _check(bitmask, (row,))
        stride = bitmask.shape[1] * 4
        self._m.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * stride, stride)

    def is_terminated(self) -> bool:
        return self._m.is_stopped()

    def fork(self) -> GuidanceGrammar:
        return GuidanceGrammar(self._m.deep_copy(), self._eos, self._eos_after_stop)

    @property
    def matcher(self) -> llguidance.LLMatcher:
        return self._m


class GuidanceBackend(StructuredOutputBackend):
    """Building the llguidance tokenizer takes about a second (it indexes every token's bytes); build one
    backend per process and share it.

    `fill_threads` > 1 fills a batch's rows on an llguidance thread pool.  Off by default: a mask row takes
    ~10-30 us, so 16 rows are ~0.2 ms either way on a small host, and on a CPU-only server the pool's threads would
    compete with torch's for the cores the forward pass is using.  Worth turning on where the model runs on an
    accelerator and host cores sit idle."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, *, eos_token_ids: Sequence[int] | None = None,
        fill_threads: int = 0,
    ) -> None:
        super().__init__(tokenizer, vocab_size)
        if vocab_size < len(tokenizer):
            raise ValueError(f"vocab_size ({vocab_size}) is smaller than the tokenizer's {len(tokenizer)} tokens")
        # n_vocab = the model's logits width: llguidance then sizes its masks to match our bitmask rows, and the
        # padding ids past the tokenizer are simply never allowed.
        eos = list(eos_token_ids) if eos_token_ids else None
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self._eos = frozenset(self.ll_tokenizer.eos_tokens)
        self.width = bitmask_width(vocab_size)
        self.fill_threads = fill_threads
        self._executor: llguidance.LLExecutor | None = None

    def compile(self, params: StructuredOutputsParams) -> GuidanceGrammar:
        spec = grammar_spec(params)
        # LLMatcher never raises for a bad grammar: it enters an error state we turn into ValueError.  It drops the
        # GIL while building, so compiling in a worker thread does not stall the step loop.
        matcher = llguidance.LLMatcher(self.ll_tokenizer, spec, log_level=0, limits=_LIMITS)
        if matcher.is_error():
            raise _invalid(params, matcher.get_error())
        if not self._satisfiable(matcher):
            raise _invalid(params, "no output of this model's vocabulary satisfies the grammar")
        return GuidanceGrammar(matcher, self._eos)

    def _satisfiable(self, matcher: llguidance.LLMatcher) -> bool:
        """Whether the grammar allows a first token.  A grammar no text of this vocabulary satisfies (an empty
        character class, a dead end) leaves only EOS in its first mask (or errors) without accepting: sampling it
        would force a token the grammar refuses, so it is refused now, as a 400.  (A grammar that accepts only the
        empty string is satisfiable: its answer is empty, finish_reason "stop".)"""
        mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32).copy()
        if matcher.is_error():
            return False
        for t in self._eos:
            if t // 32 < len(mask):
                mask[t // 32] &= ~np.uint32(1 << (t % 32))
        return bool(mask.any()) or matcher.is_accepting()

    def fill_bitmasks(self, items: Sequence[tuple[Grammar, int]], bitmask: torch.Tensor) -> None:
        if self.fill_threads <= 1 or len(items) < _PAR_FILL_MIN_ROWS:
            super().fill_bitmasks(items, bitmask)
            return
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self.fill_threads)
        pairs = [(g.matcher, row) for g, row in items]  # type: ignore[attr-defined]
        _check(bitmask, [row for _, row in pairs])
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])
