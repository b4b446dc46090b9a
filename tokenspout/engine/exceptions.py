"""Errors the frontend raises to its users."""


class EngineDeadError(RuntimeError):
    """The engine-core process died or failed; in-flight requests cannot complete."""
