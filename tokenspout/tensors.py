"""int64 index tensors from short Python lists, for the per-step hot path.

torch.tensor(list) costs ~7-10 us per call here even for an empty or one-element list (it walks the list in
Python-object form); np.array + torch.from_numpy makes the same tensor in ~3 us.  A step builds a dozen of them
(rows, positions, selections), which added up to ~0.1 ms of a ~7 ms batch-1 step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def long_tensor(values: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
    """A 1-D int64 tensor of `values` (on `device`, default the CPU)."""
    t = torch.from_numpy(np.array(values, dtype=np.int64))
    return t if device is None or device.type == "cpu" else t.to(device)
