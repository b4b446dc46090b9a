"""Random rows on the CPU in one kernel call (kernels/csrc/sample_cpu.c): truncation and draw together.

The torch path runs ~160 small ops for one row with top-k, top-p and a temperature (~0.8 ms at batch 1 on
this CPU, more when they wake a sleeping OpenMP thread; a temperature-only row costs as much, a top-p row with
a wide nucleus several ms); the kernel does the same work in one or two passes over the row (~0.05-0.1 ms).
Same semantics and the same counter-based noise as topk_topp.py + nucleus.py + draw.py.  Which path a row
takes depends only on the row (its top_k, whether it asks for processed logprobs) and the process (the kernel
library loaded), never on its batch neighbours.
"""

from __future__ import annotations

import ctypes

import torch

from tokenspout.sample.metadata import SamplingMetadata

KERNEL_MAX_TOP_K = 1024  # largest top_k the kernel takes: its heap and sort grow with k


def load() -> ctypes.CDLL | None:
    """The kernel library, or None (no AVX2 / compiler / TOKENSPOUT_KERNELS=0): then the torch path only."""
    from tokenspout.kernels import cpu  # deferred: only a CPU sampler needs the kernels

    return cpu.load()


def argmax_rows(lib: ctypes.CDLL | None, x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) for x [B, V] (the greedy rows' tokens): the kernel on float32 CPU rows of unit stride when the
    library loaded (torch's CPU argmax is a scalar loop, ~20x slower at [64, 49152]), else torch's."""
    if lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
        return x.argmax(-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.ts_argmax_rows(x.data_ptr(), x.stride(0), x.shape[1], x.shape[0], out.data_ptr())
    return out


def sample_rows(lib: ctypes.CDLL, x: torch.Tensor, rows: torch.Tensor, meta: SamplingMetadata,
                block_size: int) -> torch.Tensor:
    """One drawn token id per row in `rows` [n] of x [B, V] (float32, CPU, unit stride along V)."""
    assert x.dtype == torch.float32 and x.stride(1) == 1 and x.device.type == "cpu"
    knobs = [t.contiguous() for t in (meta.temperature, meta.top_k, meta.top_p, meta.min_p, meta.seed_keys,
                                      meta.positions)]
    out = torch.empty(rows.numel(), dtype=torch.int64)
    lib.ts_sample_rows(x.data_ptr(), x.stride(0), x.shape[1], rows.data_ptr(), rows.numel(),
                       *(t.data_ptr() for t in knobs), block_size, out.data_ptr())
    return out


def sample_rows_warped(lib: ctypes.CDLL, x: torch.Tensor, rows: torch.Tensor, meta: SamplingMetadata,
                       block_size: int, table: torch.Tensor) -> torch.Tensor:
    """sample_rows for rows with 1 <= top_k <= KERNEL_MAX_TOP_K that use the warpers (ops/warpers.py): table
    [B, 8] holds each batch row's warper knobs (WarpBatch.table).  Same semantics and noise as the torch path."""
    assert x.dtype == torch.float32 and x.stride(1) == 1 and x.device.type == "cpu"
    knobs = [t.contiguous() for t in (meta.temperature, meta.top_k, meta.top_p, meta.min_p, meta.seed_keys,
                                      meta.positions)]
    table = table.contiguous()
    out = torch.empty(rows.numel(), dtype=torch.int64)
    lib.ts_sample_rows_warped(x.data_ptr(), x.stride(0), x.shape[1], rows.data_ptr(), rows.numel(),
                              *(t.data_ptr() for t in knobs), block_size, table.data_ptr(), out.data_ptr())
    return out


def sample_rows_mirostat(lib: ctypes.CDLL, x: torch.Tensor, meta: SamplingMetadata, block_size: int,
                         rows: list[int], mode: torch.Tensor, mu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mirostat rows (ops/mirostat.py), mode / mu [n] theirs: (drawn ids [n], the drawn tokens' log probabilities
    among the kept ones [n] float64, for the mu update)."""
    assert x.dtype == torch.float32 and x.stride(1) == 1 and x.device.type == "cpu"
    idx = torch.tensor(rows, dtype=torch.int64)
    knobs = [t.contiguous() for t in (meta.temperature, meta.seed_keys, meta.positions)]
    mode, mu = mode.contiguous(), mu.to(torch.float32).contiguous()
    out = torch.empty(len(rows), dtype=torch.int64)
    lp = torch.empty(len(rows), dtype=torch.float64)
    lib.ts_sample_rows_mirostat(x.data_ptr(), x.stride(0), x.shape[1], idx.data_ptr(), len(rows),
                                *(t.data_ptr() for t in knobs), block_size, mode.data_ptr(), mu.data_ptr(),
                                out.data_ptr(), lp.data_ptr())
    return out, lp
