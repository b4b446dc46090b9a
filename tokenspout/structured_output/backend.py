"""The grammar-backend interface: what the StructuredOutputManager needs from llguidance (or xgrammar).

A backend turns a request's StructuredOutputsParams into a Grammar: a matcher that tracks the tokens generated
so far and says which token may come next.  Bitmask layout (shared with the sampler's apply_grammar_bitmask):
int32 words, token t allowed iff (mask[row, t // 32] >> (t % 32)) & 1; padding columns past the tokenizer's
vocabulary are never set in a grammar row.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the API server validates specs through this package without torch
    import torch

from tokenspout.sampling_params import StructuredOutputsParams


def lark_regex_escape(text: str) -> str:
    """`text` as a literal inside a Lark /regex/ of llguidance (Rust regex syntax: `\\<` would be a word boundary,
    so only the metacharacters and the slash are escaped)."""
    out = []
    for c in text:
        if c == "\n":
            out.append("\\n")
        elif c in ".^$*+?()[]{}|\\-/#&~":
            out.append("\\" + c)
        else:
            out.append(c)
    return "".join(out)


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row: ceil(vocab_size / 32)."""
    return (vocab_size + 31) // 32


def spec_key(params: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, text) identifying a grammar: the compile cache's key.  Schemas are keyed by their exact text, not a
    normalised form: property order decides the order of keys in the output, so two orderings are two grammars."""
    kind, text = _spec_key(params)
    if params.reasoning_end is None:
        return kind, text
    return kind, f"{text}\x00after:{params.reasoning_end}\x00opened-by:{params.reasoning_start}"


def constraint_field(params: StructuredOutputsParams) -> str:
    """The request field an error about this grammar names: the one it came from (params.source, set by the API
    server), else structured_outputs.<kind>."""
    if params.source is not None and params.source != "structured_outputs":
        return params.source
    return f"structured_outputs.{_spec_key(params)[0]}"


class GrammarFailed(ValueError):  # noqa: N818 (a ValueError: bad input, the request's fault)
    """The matcher failed while advancing over a token its mask allowed: one of the grammar engine's limits
    (llguidance: "too many expressions constructed" for a huge counted repetition) that validation cannot see
    before the lexer expands the grammar.  The request's grammar is at fault, not the engine."""


def _spec_key(params: StructuredOutputsParams) -> tuple[str, str]:
    if params.json is not None:
        return ("json", params.json)
    if params.regex is not None:
        return ("regex", params.regex)
    if params.choice is not None:
        return ("choice", json.dumps(params.choice))  # unambiguous, unlike any separator join
    if params.grammar is not None:
        return ("grammar", params.grammar)
    return ("json_object", "")


class Grammar(ABC):
    """One request's matcher state.  Not thread-safe: the engine core's step loop is its only user."""

    @abstractmethod
    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advances over all of `token_ids`, or over none of them and returns False if any is not allowed
        (GrammarFailed, with the grammar engine's message, where the grammar itself broke on them)."""

    @abstractmethod
    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of a drafted run the grammar would accept, without advancing."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens (speculative decoding's rejected drafts)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into bitmask[row] (CPU int32); EOS is set only where the grammar may end."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar admits no further token except EOS (or EOS was accepted)."""

    @abstractmethod
    def fork(self) -> Grammar:
        """An independent copy in the same state (the cache hands each request a fork of a pristine grammar)."""


class StructuredOutputBackend(ABC):
    """Compiles StructuredOutputsParams into Grammars for one tokenizer and one model vocabulary width."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """A fresh Grammar at its start state; ValueError naming the problem if the spec is invalid.  May take
        milliseconds to seconds for large schemas: the manager runs it in a worker thread."""

    def fill_bitmasks(self, items: Sequence[tuple[Grammar, int]], bitmask: torch.Tensor) -> None:
        """Fills bitmask[row] for each (grammar, row).  Backends with a batched fill override this."""
        for grammar, row in items:
            grammar.fill_bitmask(bitmask, row)
