"""Architecture name -> model class.  All supported architectures share the Llama-family implementation."""

from __future__ import annotations

from tokenspout.config import SUPPORTED_ARCHITECTURES
from tokenspout.models.llama import LlamaForCausalLM

_REGISTRY = {name: LlamaForCausalLM for name in SUPPORTED_ARCHITECTURES}


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(sorted(_REGISTRY))}"
        ) from None
