"""SamplingMetadata: everything the sampler needs for one step, row i of the logits being the step's i-th row.

Built by SamplingState (worker/sampling_state.py) from its per-request records.  Each fact has one form: [R]
tensors for the per-row knobs the sampling ops compute with, host lists for the row classes the sampler plans
with (they decide which paths run, so reading them never waits for the device), and properties for the forms
derived from those cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenspout.sample.ops.mirostat import MirostatBatch
from tokenspout.sample.ops.penalties import PenaltyBatch
from tokenspout.sample.ops.warpers import WarpBatch
from tokenspout.tensors import long_tensor


@dataclass(slots=True)
class SamplingMetadata:
    # Per-row knobs, [R].
    temperature: torch.Tensor  # float32; 1.0 on greedy rows (the zero guard: greedy rows never divide by ~0)
    top_k: torch.Tensor  # int64; 0 = off (values >= vocab are normalised to 0)
    top_p: torch.Tensor  # float32; 1.0 = off
    min_p: torch.Tensor  # float32; 0.0 = off
    seeds: torch.Tensor  # int64, the effective 63-bit seed of each row's request
    seed_keys: torch.Tensor  # int64, noise.seed_key(seed), hashed once per request (noise.keys_from_seed_keys)
    positions: torch.Tensor  # int64, output tokens generated so far (the draw's counter)
    # Row classes, ascending row indices, decided on the host.
    greedy_rows: list[int]
    truncated_rows: list[int]  # random rows with top-k, top-p or min_p
    truncated_top_k: list[int]  # top_k of each truncated row (plans candidate-set sizes)
    plain_rows: list[int]  # random rows with none of them (temperature only): drawn densely
    kernel_rows: list[int]  # random rows with top_k <= KERNEL_MAX_TOP_K (0 = off) and no processed logprobs:
    # the CPU kernel (ops/rows_cpu.py) may draw them (they need no kept distribution afterwards)
    any_top_p: bool  # some truncated row has top_p < 1
    any_min_p: bool  # some truncated row has min_p > 0
    # Sparse edits; None when no row has any.
    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, local row, id) allowed pairs
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (row, id) pairs forced to -inf: bad words, min_tokens
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (row, id, clamped bias)
    penalties: PenaltyBatch | None
    # Logprobs.
    max_num_logprobs: int  # -1 if no row asks
    raw_logprob_rows: torch.Tensor  # rows asking for raw logprobs (log_softmax before any processing)
    processed_logprob_rows: torch.Tensor  # rows asking for logprobs of the processed distribution
    grammar_bitmask: torch.Tensor | None = None  # [R, ceil(V/32)] int32, bit set = allowed; set by the caller
    # Random rows using typical_p / epsilon / eta / top_n_sigma / XTC / dynatemp (ops/warpers.py); None when no row
    # does, and then the sampler pays nothing for them.  These rows are never kernel rows.
    warp: WarpBatch | None = None
    dry: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (row, id, -penalty): DRY, after penalties
    mirostat: MirostatBatch | None = None  # random rows with mirostat 1 / 2 (ops/mirostat.py); never kernel rows
    # Warped rows the CPU kernel may draw (1 <= top_k <= KERNEL_MAX_TOP_K, no processed logprobs): the sampler takes
    # them out of `warp` when it does.
    warp_kernel_rows: list[int] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @property
    def all_greedy(self) -> bool:
        return len(self.greedy_rows) == self.num_rows

    @property
    def any_greedy(self) -> bool:
        return bool(self.greedy_rows)

    @property
    def any_top_k(self) -> bool:
        """Some truncated row has top-k on."""
        return any(k > 0 for k in self.truncated_top_k)

    @property
    def is_greedy(self) -> torch.Tensor:
        """[R] bool mask of the greedy rows, for callers that select per row with torch.where (built on each
        call: the sampler itself works from greedy_rows)."""
        mask = torch.zeros(self.num_rows, dtype=torch.bool, device=self.temperature.device)
        if self.greedy_rows:
            mask[long_tensor(self.greedy_rows, mask.device)] = True
        return mask
