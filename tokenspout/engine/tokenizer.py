"""Loads the tokenizer of a local model folder (never from a hub)."""

from __future__ import annotations

import json
from pathlib import Path

# tokenizer_config.json classes that AutoTokenizer loads as they are named for a "llama" model without remote code
# (the generic tokenizers-library backend; transformers 5 maps no specialised tokenizer to "llama" and does not
# list it among the model types whose hub tokenizer class it overrides).
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _generic_tokenizer_class(path: Path) -> str | None:
    """The class name when AutoTokenizer would just load tokenizer_config.json's generic class, else None.

    Why: AutoTokenizer always builds the model's AutoConfig first, and importing transformers' config machinery
    imports torch, torch.distributed, accelerate and sympy: ~5 s of CPU in the API server's process, which otherwise
    never imports torch.  The generic class alone loads in ~1 s (tests/unit/test_startup.py checks it gives the
    same tokenizer as AutoTokenizer)."""
    try:
        tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
        model_cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    cls = tok_cfg.get("tokenizer_class")
    if cls not in _GENERIC_CLASSES or "auto_map" in tok_cfg or model_cfg.get("model_type") != "llama":
        return None
    return cls


def load_tokenizer(path: Path | str):
    path = Path(path)
    try:
        cls = _generic_tokenizer_class(path)
        if cls is not None:
            import transformers

            return getattr(transformers, cls).from_pretrained(str(path), local_files_only=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load the tokenizer from {path}: {e}") from e
