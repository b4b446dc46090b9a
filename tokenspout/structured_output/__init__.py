"""Structured output (grammar-constrained decoding): JSON schema, regex, choice, Lark/GBNF grammars.

The frontend calls `validate(params)` at request time (ValueError -> HTTP 400); the engine core owns a
StructuredOutputManager that compiles grammars off the step loop and fills the sampler's grammar bitmask.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenspout.sampling_params import StructuredOutputsParams
from tokenspout.structured_output.backend import Grammar, StructuredOutputBackend, bitmask_width

if TYPE_CHECKING:
    from tokenspout.structured_output.manager import StructuredOutputManager


def __getattr__(name: str):
    # The manager (the engine's) imports torch; the API server only calls validate() and never imports torch.
    if name == "StructuredOutputManager":
        from tokenspout.structured_output.manager import StructuredOutputManager

        return StructuredOutputManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def validate(params: StructuredOutputsParams, backend: str = "guidance") -> None:
    """Synchronous, tokenizer-free check of a request's structured-output spec; ValueError names the problem."""
    if backend not in ("guidance", "llguidance"):
        raise ValueError(f"structured output backend must be 'guidance', got {backend!r}")
    from tokenspout.structured_output.llguidance_backend import validate as guidance_validate

    guidance_validate(params)


__all__ = ["Grammar", "StructuredOutputBackend", "StructuredOutputManager", "bitmask_width", "validate"]
