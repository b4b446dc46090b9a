"""The sampler: logits [B, V] + SamplingMetadata -> one token id per row (and logprobs if asked).

Order (DESIGN invariant 2): raw logprobs -> float32 -> allowed / bad-word / no-repeat-ngram / grammar masks ->
min_tokens, logit_bias, penalties, DRY -> greedy argmax (an all-greedy batch stops here: no top-k, no sort, no noise) ->
top_n_sigma -> temperature (or dynatemp) -> min_p -> top-k / top-p on a candidate set (ops/topk_topp.py) -> typical_p
-> epsilon -> eta -> XTC (ops/warpers.py, only on the rows that use one) -> two-level Gumbel-max
draw from counter-based noise (ops/draw.py, ops/noise.py) -> per row, the argmax on greedy rows and the draw on
the others (one index_copy of the greedy rows' argmax into the draws).

The sampler owns the logits it is given: float32 logits are modified in place (penalties, masks), which
saves a [B, V] copy per step.  Callers that need them afterwards pass a clone.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenspout.sample.metadata import SamplingMetadata
from tokenspout.sample.ops import mirostat, rows_cpu, warpers
from tokenspout.sample.ops.draw import block_mass, draw_dense, draw_sparse
from tokenspout.sample.ops.logprobs import gather_logprobs
from tokenspout.sample.ops.masks import apply_allowed, apply_bans, apply_bias, apply_grammar_bitmask
from tokenspout.sample.ops.noise import keys_from_seed_keys
from tokenspout.sample.ops.penalties import apply_penalties
from tokenspout.sample.ops.topk_topp import DenseKept, Kept, SparseKept, TierConfig, materialize, truncate
from tokenspout.tensors import long_tensor

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LogprobsTensors:
    token_ids: torch.Tensor  # [B, N+1] int64: column 0 the sampled token, then the top-N, best first
    logprobs: torch.Tensor  # [B, N+1] float32
    ranks: torch.Tensor  # [B] int64, rank of the sampled token (1 = best)


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # rows that did not ask hold zeros


def apply_logits_processors(x: torch.Tensor, meta: SamplingMetadata) -> None:
    """Masks, then the argmax-changing processors, in place on float32 logits x [B, V]."""
    if meta.allowed is not None:
        apply_allowed(x, *meta.allowed)
    if meta.grammar_bitmask is not None:
        apply_grammar_bitmask(x, meta.grammar_bitmask)
    if meta.banned is not None:  # bad words and min_tokens: both are plain -inf, so one scatter
        apply_bans(x, *meta.banned)
    if meta.bias is not None:
        apply_bias(x, *meta.bias)
    if meta.penalties is not None:
        apply_penalties(x, meta.penalties)
    if meta.dry is not None:  # DRY's penalties (ops/repeats.py), subtracted as a bias after the other penalties
        apply_bias(x, *meta.dry)


def draw(kept: Kept, meta: SamplingMetadata, vocab: int, block_size: int) -> torch.Tensor:
    """One drawn token per row [B] (rows without a kept distribution -- greedy ones -- get 0)."""
    parts: list[SparseKept | DenseKept] = [*kept.sparse, *kept.dense]
    if not parts:
        return torch.zeros(meta.num_rows, dtype=torch.int64, device=meta.seed_keys.device)
    keys = keys_from_seed_keys(meta.seed_keys, meta.positions)

    def one(part: SparseKept | DenseKept, k: torch.Tensor) -> torch.Tensor:
        if isinstance(part, SparseKept):
            return draw_sparse(part.ids, part.logits, k, vocab, block_size)
        return draw_dense(part.logits, part.mass, k, block_size)

    if len(parts) == 1 and parts[0].rows.numel() == meta.num_rows:  # one part holding every row, in order
        return one(parts[0], keys)
    drawn = torch.zeros(meta.num_rows, dtype=torch.int64, device=keys.device)
    for part in parts:
        drawn.index_copy_(0, part.rows, one(part, keys.index_select(0, part.rows)))
    return drawn


def _locate(rows: list[int], part_rows: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices into part_rows of the batch rows in `rows`, their index in `rows`)."""
    where = torch.full((num_rows,), -1, dtype=torch.int64, device=part_rows.device)
    where[long_tensor(rows, part_rows.device)] = torch.arange(len(rows), device=part_rows.device)
    w = where.index_select(0, part_rows)
    sel = (w >= 0).nonzero().squeeze(-1)
    return sel, w.index_select(0, sel)


def _edit_rows(kept: Kept, rows: list[int], num_rows: int, block_size: int,
               fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """Replaces the kept logits of `rows` by fn(their kept logits, their index in `rows`, their batch rows), in
    whichever parts (candidate sets or dense rows) they are."""
    parts: list[SparseKept | DenseKept] = [*kept.sparse, *kept.dense]
    for part in parts:
        sel, idx = _locate(rows, part.rows, num_rows)
        if not sel.numel():
            continue
        every = sel.numel() == part.rows.numel()  # (index_select of whole [R, V] rows is very slow on CPU torch)
        y = fn(part.logits if every else part.logits[sel], idx, part.rows if every else part.rows[sel])
        # Out of place: a dense part's logits may be x itself (temperature 1, no min_p).
        if every:
            part.logits = y
        else:
            part.logits = part.logits.clone()
            part.logits[sel] = y
        if isinstance(part, DenseKept):
            mass = block_mass(y.softmax(-1), block_size)
            if every:
                part.mass = mass
            else:
                part.mass[sel] = mass


def truncate_and_warp(x: torch.Tensor, meta: SamplingMetadata, tiers: TierConfig,
                      only: tuple[list[int], list[int], list[int]] | None = None) -> Kept:
    """truncate() with the warpers (ops/warpers.py) around it on the rows that use one -- top_n_sigma (in place on
    x) and dynatemp before, typical / epsilon / eta / XTC on the kept rows after -- and mirostat's cut on its rows
    (ops/mirostat.py).  Without such rows: truncate()."""
    wb, mb = meta.warp, meta.mirostat
    if wb is None and mb is None:
        return truncate(x, meta, tiers, only)
    tmeta = meta
    if wb is not None:
        temperature = warpers.pre_truncation(x, meta.temperature, meta.top_k, wb)
        if temperature is not meta.temperature:
            tmeta = dataclasses.replace(meta, temperature=temperature)
    kept = truncate(x, tmeta, tiers, only)
    if wb is not None:
        def warp(y: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            assert wb is not None
            return warpers.post_truncation(y, wb, idx, meta.seed_keys.index_select(0, rows),
                                           meta.positions.index_select(0, rows))
        _edit_rows(kept, wb.rows, meta.num_rows, tiers.block_size, warp)
    if mb is not None:
        def cut(y: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            assert mb is not None
            return y.masked_fill(~mirostat.keep_mask(y, mb.mode.index_select(0, idx), mb.mu.index_select(0, idx)),
                                 float("-inf"))
        _edit_rows(kept, mb.rows, meta.num_rows, tiers.block_size, cut)
    return kept


def update_mirostat(kept: Kept, meta: SamplingMetadata, sampled: torch.Tensor) -> None:
    """Mirostat's mu update from each mirostat row's drawn token and kept distribution (writes the requests'
    states; on CPU the values are already on the host)."""
    mb = meta.mirostat
    assert mb is not None
    parts: list[SparseKept | DenseKept] = [*kept.sparse, *kept.dense]
    for part in parts:
        sel, idx = _locate(mb.rows, part.rows, meta.num_rows)
        if not sel.numel():
            continue
        every = sel.numel() == part.rows.numel()
        logits = part.logits if every else part.logits[sel]
        tok = sampled.index_select(0, part.rows if every else part.rows[sel])
        if isinstance(part, SparseKept):  # the drawn token's column among the candidates
            col = (part.ids.index_select(0, sel) == tok.unsqueeze(-1)).float().argmax(-1)
        else:
            col = tok
        mirostat.update([mb.states[i] for i in idx.tolist()], logits, col, mb.tau.index_select(0, idx),
                        mb.eta.index_select(0, idx))


def _float32(logits: torch.Tensor) -> torch.Tensor:
    x = logits if logits.dtype == torch.float32 else logits.float()
    return x.contiguous()


def compute_processed_logits(
    logits: torch.Tensor, metadata: SamplingMetadata, tiers: TierConfig | None = None
) -> torch.Tensor:
    """The logits of each row's processed distribution [B, V] float32: after masks, penalties,
    temperature, min_p, top-k and top-p, -inf where dropped; softmax gives what the sampler draws from.
    Greedy rows get the logits after masks and penalties (temperature 1, no truncation).
    Does not modify `logits`."""
    x = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
    apply_logits_processors(x, metadata)
    if metadata.all_greedy:
        return x
    return materialize(x, truncate_and_warp(x, metadata, tiers or TierConfig()))


class Sampler(torch.nn.Module):
    def __init__(self, tiers: TierConfig | None = None, cpu_kernel: bool = True) -> None:
        """cpu_kernel: draw random rows of CPU logits with the one-call kernel (ops/rows_cpu.py) when it loads."""
        super().__init__()
        self.tiers = tiers or TierConfig()
        self._lib = rows_cpu.load() if cpu_kernel else None

    def _kernel_split(
        self, x: torch.Tensor, meta: SamplingMetadata
    ) -> tuple[list[int], list[int], list[int], tuple[list[int], list[int], list[int]] | None]:
        """(random rows the kernel draws, warped rows the warped kernel draws, mirostat rows the mirostat kernel
        draws, (the other truncated rows, their top_k, the other plain rows) for the torch path)."""
        mirostat_rows = meta.mirostat.kernel_rows if meta.mirostat is not None else []
        if self._lib is None or x.device.type != "cpu" or not (meta.kernel_rows or meta.warp_kernel_rows
                                                               or mirostat_rows):
            return [], [], [], None
        ok = set(meta.kernel_rows) | set(meta.warp_kernel_rows) | set(mirostat_rows)
        trunc = [(r, k) for r, k in zip(meta.truncated_rows, meta.truncated_top_k) if r not in ok]
        plain = [r for r in meta.plain_rows if r not in ok]
        return (meta.kernel_rows, meta.warp_kernel_rows, mirostat_rows,
                ([r for r, _ in trunc], [k for _, k in trunc], plain))

    def _kernels(self, x: torch.Tensor, meta: SamplingMetadata, plain: list[int], warp: list[int],
                 miro: list[int]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], SamplingMetadata]:
        """The rows the CPU kernels draw, as (rows, drawn ids) pairs, and the metadata left for the torch path
        (the warped and mirostat batches without those rows).  Runs before truncate_and_warp, which edits x on the
        torch path's warped rows."""
        lib, bs = self._lib, self.tiers.block_size
        assert lib is not None
        done = []
        if plain:
            rows = long_tensor(plain)
            done.append((rows, rows_cpu.sample_rows(lib, x, rows, meta, bs)))
        if warp:
            assert meta.warp is not None
            rows = long_tensor(warp)
            done.append((rows, rows_cpu.sample_rows_warped(lib, x, rows, meta, bs, meta.warp.table(meta.num_rows))))
            meta = dataclasses.replace(meta, warp=meta.warp.without(set(warp)))
        if miro:
            mb = meta.mirostat
            assert mb is not None
            taken = set(miro)
            pos = [i for i, r in enumerate(mb.rows) if r in taken]
            idx = long_tensor(pos)
            ids, lp = rows_cpu.sample_rows_mirostat(lib, x, meta, bs, miro, mb.mode[idx], mb.mu[idx])
            mirostat.update_from_logprobs([mb.states[i] for i in pos], lp, mb.tau[idx], mb.eta[idx])
            done.append((long_tensor(miro), ids))
            meta = dataclasses.replace(meta, mirostat=mb.select([i for i in range(len(mb.rows)) if i not in pos]))
        return done, meta

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        meta = metadata
        batch, vocab = logits.shape
        raw = None
        if meta.raw_logprob_rows.numel():
            rows = meta.raw_logprob_rows
            src = logits if rows.numel() == batch else logits.index_select(0, rows)
            raw = src.float().log_softmax(-1)
        x = _float32(logits)
        apply_logits_processors(x, meta)

        kept = None
        if meta.all_greedy:
            sampled = rows_cpu.argmax_rows(self._lib, x)
        else:
            greedy = None
            if meta.any_greedy:  # argmax of the greedy rows only, before anything below touches x
                greedy_rows = long_tensor(meta.greedy_rows, x.device)
                greedy = (greedy_rows, rows_cpu.argmax_rows(self._lib, x.index_select(0, greedy_rows)))
            plain, warp, miro, others = self._kernel_split(x, meta)
            done: list[tuple[torch.Tensor, torch.Tensor]] = []
            if others is not None:
                done, meta = self._kernels(x, meta, plain, warp, miro)
            kept = truncate_and_warp(x, meta, self.tiers, others)
            if len(done) == 1 and done[0][0].numel() == batch:  # one kernel drew every row (ascending): the identity
                sampled = done[0][1]
            else:
                sampled = draw(kept, meta, vocab, self.tiers.block_size)
                for rows, drawn in done:
                    sampled.index_copy_(0, rows, drawn)
            if greedy is not None:  # per row: the argmax on greedy rows, the draw on the others
                sampled = sampled.index_copy(0, *greedy)
            if meta.mirostat is not None:
                update_mirostat(kept, meta, sampled)

        lp_out = None
        if meta.max_num_logprobs >= 0:
            lp_out = self._logprobs(x, kept, raw, sampled, meta)
        return SamplerOutput(sampled, lp_out)

    @staticmethod
    def _logprobs(
        x: torch.Tensor, kept: Kept | None, raw: torch.Tensor | None, sampled: torch.Tensor,
        meta: SamplingMetadata,
    ) -> LogprobsTensors:
        parts, rows = [], []
        if raw is not None:
            parts.append(raw)
            rows.append(meta.raw_logprob_rows)
        if meta.processed_logprob_rows.numel():
            prows = meta.processed_logprob_rows
            processed = x if kept is None else materialize(x, kept)
            parts.append(processed.index_select(0, prows).log_softmax(-1))
            rows.append(prows)
        lp = parts[0] if len(parts) == 1 else torch.cat(parts)
        lp_rows = rows[0] if len(rows) == 1 else torch.cat(rows)
        n = meta.max_num_logprobs
        ids, vals, ranks = gather_logprobs(lp, sampled.index_select(0, lp_rows), n)
        batch = meta.num_rows
        if lp_rows.numel() == batch and bool((lp_rows == torch.arange(batch, device=lp_rows.device)).all()):
            return LogprobsTensors(ids, vals, ranks)
        out_ids = torch.zeros(batch, n + 1, dtype=torch.int64, device=x.device).index_copy_(0, lp_rows, ids)
        out_vals = torch.zeros(batch, n + 1, dtype=torch.float32, device=x.device).index_copy_(0, lp_rows, vals)
        out_ranks = torch.zeros(batch, dtype=torch.int64, device=x.device).index_copy_(0, lp_rows, ranks)
        return LogprobsTensors(out_ids, out_vals, out_ranks)
