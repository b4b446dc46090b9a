"""Loads the tokenizer of a local model folder (never from a hub)."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load the tokenizer from {path}: {e}") from e
