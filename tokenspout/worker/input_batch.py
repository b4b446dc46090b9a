"""InputBatch: the model runner's persistent per-row state.

A request holds one row from its first scheduled step until it finishes, is aborted or is preempted.  Per row:
its block table row (filled incrementally as the request gains KV blocks) and its sampling state
(worker/sampling_state.py).

Threads.  Rows are handed out and taken back by ModelRunner.prepare() (the scheduling thread): `ensure_row`,
`release`, `sync_blocks`.  The sampling state of a row changes only in ModelRunner.run() (the thread that steps the
model), in step order: `apply` with the additions and releases a prepared step recorded.  So a row given back may
go to another request in the same prepare() even while a step in flight still uses it: that step's inputs, block
ids included, are copies, and its sampling state is replaced only when the next step runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenspout.sample.ops.mirostat import MirostatState
from tokenspout.sampling_params import SamplingParams
from tokenspout.worker.sampling_state import SamplingState

if TYPE_CHECKING:
    from tokenspout.step_io import StepSequence


@dataclass(slots=True)
class RowAdd:
    """A request taking a row: its sampling state is set up by `apply`, in step order."""

    row: int
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    seed: int
    mirostat: MirostatState | None = None  # the request's own state object (it outlives the row)


class InputBatch:
    def __init__(self, max_num_seqs: int, max_blocks: int, vocab_size: int, device: torch.device) -> None:
        # Block ids of each row's request, [max_num_seqs, max_blocks]; the numpy view shares its memory (the
        # decode-only batch is built in numpy, and element writes through numpy are cheaper than torch's).
        self.block_table = torch.zeros(max_num_seqs, max_blocks, dtype=torch.int64)
        self.block_table_np = self.block_table.numpy()
        self._num_blocks_in_row = [0] * max_num_seqs
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))  # popped from the end: row 0 first
        self.sampling = SamplingState(max_num_seqs, vocab_size, device)

    # ---- the scheduling thread (prepare) -----------------------------------------------------------------------
    def release(self, request_id: str, released: list[tuple[str, int]]) -> None:
        """Gives the request's row back, if it holds one, and records (request id, row) in `released`."""
        row = self.row_of.pop(request_id, None)
        if row is not None:
            released.append((request_id, row))
            self._num_blocks_in_row[row] = 0
            self._free_rows.append(row)

    def ensure_row(self, req: StepSequence, added: list[RowAdd]) -> int:
        """The request's row; a request without one takes a free row and is recorded in `added`."""
        row = self.row_of.get(req.request_id)
        if row is None:
            row = self._free_rows.pop()
            self.row_of[req.request_id] = row
            added.append(RowAdd(row, req.params, req.prompt_token_ids, req.output_token_ids, req.seed,
                                req.mirostat))
        return row

    def sync_blocks(self, row: int, blocks: list[int]) -> None:
        """Writes the blocks the row's request gained since the last call (a request's blocks only grow while it
        holds its row)."""
        have = self._num_blocks_in_row[row]
        if len(blocks) > have:
            self.block_table_np[row, have : len(blocks)] = blocks[have:]
            self._num_blocks_in_row[row] = len(blocks)

    # ---- the model thread (run) --------------------------------------------------------------------------------
    def apply(self, released: list[tuple[str, int]], added: list[RowAdd]) -> None:
        """A prepared step's row changes, on the sampling state: releases first (a row may be released and taken
        again in one step)."""
        for _, row in released:
            self.sampling.remove_request(row)
        for a in added:
            self.sampling.add_request(a.row, a.params, a.prompt_token_ids, a.output_token_ids, a.seed, a.mirostat)
