"""The engine's grammar manager, made on the first structured request.

The scheduler (grammar readiness, advancing and ending grammars), the model runner (bitmasks) and the speculator
(cutting n-gram drafts to what the grammar accepts) all need the StructuredOutputManager, but an engine that never
sees a grammar should pay nothing for it (no tokenizer, no llguidance import).  So each of them is given this
handle when constructed, and `manager` stays None until the engine core's first grammar request calls `get()`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenspout.structured_output.manager import StructuredOutputManager


class LazyStructuredOutputs:
    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, max_num_rows: int) -> None:
        self._load_tokenizer = load_tokenizer
        self._vocab_size = vocab_size
        self._max_num_rows = max_num_rows
        self.manager: StructuredOutputManager | None = None
        self._lock = threading.Lock()  # the engine's warm-up thread and its first grammar request may race here

    def get(self) -> StructuredOutputManager:
        """The manager, made now if this is the first grammar request."""
        with self._lock:
            if self.manager is None:
                from tokenspout.structured_output.manager import StructuredOutputManager

                self.manager = StructuredOutputManager(self._load_tokenizer(), self._vocab_size,
                                                       max_num_rows=self._max_num_rows)
            return self.manager

    def active(self) -> StructuredOutputManager | None:
        """The manager when it holds grammar requests now, else None (a step without grammars never touches it)."""
        m = self.manager
        return m if m is not None and m.num_requests else None

    def shutdown(self) -> None:
        if self.manager is not None:
            self.manager.shutdown()
