"""Type checks shared by the validators (request fields, offline parameters, model files and configs): bool is no
integer or number here, though Python counts it as one (`True` for a count, a token id or a size is a caller's
mistake, and msgspec's integer fields refuse it later, where it had killed the engine's input thread)."""

from __future__ import annotations

from typing import TypeGuard


def is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: object) -> TypeGuard[int | float]:
    return isinstance(v, int | float) and not isinstance(v, bool)
