"""Temperature, min_p, top-k and top-p on a truncated candidate set, with a proof of exactness.

Semantics (per row; y = logits / T, w = exp(y - max y), ties ordered by token id, lowest first):
- min_p keeps tokens with w >= min_p (i.e. p >= min_p * p_max), as HF MinPLogitsWarper.
- top-k keeps every token with y >= the k-th largest y (ties at the k-th value all stay), as HF
  TopKLogitsWarper.  min_p and top-k are both "y >= threshold" masks, so their order does not matter.
- top-p then works on the renormalised survivors A of min_p and top-k: a token t is kept iff the mass of
  the survivors ahead of it (larger y, or equal y and lower id) is < top_p * Z_A.  This is HF
  TopPLogitsWarper's rule (it sorts ascending and drops tokens whose cumulative mass <= 1 - top_p, always
  keeping the top one): it keeps the token that crosses top_p, and among tokens tied at the boundary it
  keeps exactly as many as HF does.  (Which tied tokens HF keeps depends on torch.sort's unstable order.)

Exactness of the truncation.  The candidates C are the K largest logits of a row, sorted; y_last is the
K-th value.  Every token outside C has y <= y_last.  A row is *covered* -- its kept set provably lies in
{c in C : y_c > y_last}, so C holds every kept token and all the mass the decisions need -- when:
  (a) top-k is on, k <= K and y_k > y_last: A is inside {y >= y_k}, which lies strictly above y_last;
  (b) min_p > 0 and w_last < min_p: every token at or below y_last fails min_p;
  (c) w_last == 0: tokens at or below y_last carry no mass at all (everything else is masked);
  (d) top-p: S = mass of the survivors strictly above y_last satisfies S >= top_p * Z_A (Z_A over the
      whole row): every token at or below y_last has at least S ahead of it, so top-p drops it.
Z_A comes from C in (a)-(c); in (d) it is a dense sum over the row (exp + block sums, no sort).
Rows not covered by K candidates retry with `second_k` candidates and finally with a full sort (K = V,
trivially covered); rows with neither top-k nor top-p (temperature and maybe min_p) whose min_p set is not
covered are drawn densely.  Coverage is decided per row with a K that depends only on the row's own
top_k, so a row takes the same path, and draws the same token, in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tokenspout.sample.ops.candidates import candidates
from tokenspout.sample.ops.draw import block_mass

if TYPE_CHECKING:
    from tokenspout.sample.metadata import SamplingMetadata

NEG_INF = float("-inf")


@dataclass(slots=True)
class SparseKept:
    """Rows whose kept tokens all lie among their candidates."""

    rows: torch.Tensor  # [Rs] rows of the batch
    ids: torch.Tensor  # [Rs, K] candidate token ids (distinct per row)
    logits: torch.Tensor  # [Rs, K] scaled logits, -inf where the token is dropped
    tier: int  # 0: first candidate set, 1: second, 2: full sort (for stats and tests)


@dataclass(slots=True)
class DenseKept:
    """Rows without top-k / top-p whose min_p set (if any) did not fit the candidates: drawn densely."""

    rows: torch.Tensor  # [Rd]
    logits: torch.Tensor  # [Rd, V] scaled logits, -inf where min_p drops the token
    mass: torch.Tensor  # [Rd, nb] block sums of the kept probabilities


@dataclass(slots=True)
class Kept:
    sparse: list[SparseKept] = field(default_factory=list)
    dense: DenseKept | None = None


@dataclass(slots=True)
class TierConfig:
    first_k: int = 128  # candidates per row in the first pass (raised to the row's top_k, up to first_cap)
    first_cap: int = 1024  # rows with a larger top_k skip to the second pass
    second_k: int = 8192  # a single-row topk(8192) costs ~1 ms on 128k logits; a full sort ~12 ms
    block_size: int = 256


def dense_probs(
    x: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scaled logits, probabilities) of dense rows, both with min_p applied (-inf / 0 where dropped).

    torch's softmax is one fused row-wise kernel (max, exp, sum, scale), ~3x cheaper here than the same
    steps as separate passes, and it computes each row on one thread: the same bits in any batch."""
    y = x if bool((temperature == 1.0).all()) else x / temperature.unsqueeze(-1)
    p = y.softmax(-1)
    if min_p is not None:
        drop = p < min_p.unsqueeze(-1) * p.amax(-1, keepdim=True)  # HF MinPLogitsWarper's test
        p.masked_fill_(drop, 0.0)
        y = y.masked_fill(drop, NEG_INF)
    return y, p


def _dense_z(
    x: torch.Tensor, rows: torch.Tensor, top_ids: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Z_A of `rows` in the candidates' units (the top token weighs 1): sum(p over A) / p_top."""
    every = rows.numel() == x.shape[0]
    xr, t, mp = (x, temperature, min_p) if every else (x[rows], temperature[rows], min_p[rows])
    _, p = dense_probs(xr, t, mp if bool((mp > 0).any()) else None)
    total = block_mass(p, block_size).sum(-1) if bool((mp > 0).any()) else 1.0
    return total / p.gather(1, top_ids).squeeze(-1)


def _resolve(
    x: torch.Tensor,
    k_row: torch.Tensor,
    k: int,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    z_dense: torch.Tensor | None,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One pass over rows x [R, V] with k candidates (row r looks only at its first k_row[r]).

    Returns (ids, kept logits, covered, plain, retry, z_dense): `plain` rows have no top-k/top-p and an
    uncovered min_p set (draw them densely), `retry` rows need more candidates; z_dense caches Z_A of
    rows that needed the dense sum (NaN elsewhere) for the next pass."""
    vocab = x.shape[1]
    y, ids = candidates(x, k, temperature)
    col = torch.arange(y.shape[1], device=y.device)
    m = y[:, :1]
    m = torch.where(torch.isfinite(m), m, 0.0)
    w = (y - m).exp_()
    y_last = y.gather(1, (k_row - 1).unsqueeze(-1))
    w_last = (y_last - m).exp_().squeeze(-1)

    topk_on = top_k > 0
    # A top_k beyond k_row keeps every candidate strictly above y_last, so it cannot bind inside C.
    topk_fits = topk_on & (top_k <= k_row)
    kth = y.gather(1, (top_k - 1).clamp(0, y.shape[1] - 1).unsqueeze(-1))
    keep = (col < k_row.unsqueeze(-1)) & (w > 0) & (w >= min_p.unsqueeze(-1))
    keep &= ~topk_fits.unsqueeze(-1) | (y >= kth)
    in_c = (topk_fits & (kth > y_last).squeeze(-1)) | ((min_p > 0) & (w_last < min_p)) | (w_last == 0)
    if k >= vocab:
        in_c[:] = True
    wa = w * keep
    z = wa.sum(-1)
    # (d) needs Z over the whole row; with top-k on but not covered, A reaches past C, so retry instead.
    need_z = (top_p < 1) & ~in_c & ~topk_on
    if bool(need_z.any()):
        if z_dense is None:
            z_dense = torch.full_like(z, float("nan"))
        missing = (need_z & z_dense.isnan()).nonzero().squeeze(-1)
        if missing.numel():
            z_dense[missing] = _dense_z(x, missing, ids[missing, :1], temperature, min_p, block_size)
        z = torch.where(need_z, z_dense, z)
    ahead = wa.cumsum(-1) - wa
    keep &= (top_p >= 1).unsqueeze(-1) | (ahead < (top_p * z).unsqueeze(-1))
    above = (wa * (y > y_last)).sum(-1)
    covered = in_c | (need_z & (above >= top_p * z))
    plain = ~covered & (top_p >= 1) & ~topk_on
    retry = ~covered & ~plain
    return ids, y.masked_fill(~keep, NEG_INF), covered, plain, retry, z_dense


def truncate(x: torch.Tensor, meta: SamplingMetadata, cfg: TierConfig) -> Kept:
    """The kept distribution (after temperature, min_p, top-k, top-p) of every random row of x [B, V]."""
    vocab = x.shape[1]
    out = Kept()
    plain_rows = [meta.plain_rows]
    rows = meta.truncated_rows
    if rows.numel():
        params = [t.index_select(0, rows) for t in (meta.temperature, meta.top_k, meta.top_p, meta.min_p)]
        xr = x if rows.numel() == x.shape[0] else x.index_select(0, rows)
        # First pass: K per row from its own top_k only, so a row's path never depends on its neighbours.
        # top_k + 1: covering a top-k needs one candidate past the k-th to show the k-th value is not tied.
        first = min(vocab, max(cfg.first_k, min(meta.max_top_k + 1, cfg.first_cap)))
        wanted = params[1] + 1
        k_row = torch.where((wanted > cfg.first_k) & (wanted <= cfg.first_cap), wanted, cfg.first_k)
        k_row = k_row.clamp_(max=first)
        z_dense: torch.Tensor | None = None
        for tier, k in enumerate((first, min(vocab, cfg.second_k), vocab)):
            if tier and k <= first:
                continue
            if tier:
                k_row = torch.full_like(params[1], k)
            ids, kept, covered, plain, retry, z_dense = _resolve(xr, k_row, k, *params, z_dense, cfg.block_size)
            if bool(covered.any()):
                sel = covered.nonzero().squeeze(-1)
                out.sparse.append(SparseKept(rows[sel], ids[sel], kept[sel], tier))
            if bool(plain.any()):
                plain_rows.append(rows[plain])
            if not bool(retry.any()):
                break
            sel = retry.nonzero().squeeze(-1)
            rows, xr = rows[sel], xr[sel]
            params = [t[sel] for t in params]
            z_dense = None if z_dense is None else z_dense[sel]
    dense = torch.cat(plain_rows).sort().values  # ascending, so a full set of rows is the identity
    if dense.numel():
        temp = meta.temperature.index_select(0, dense)
        min_p = meta.min_p.index_select(0, dense)
        xd = x if dense.numel() == x.shape[0] else x.index_select(0, dense)
        y, p = dense_probs(xd, temp, min_p if bool((min_p > 0).any()) else None)
        out.dense = DenseKept(dense, y, block_mass(p, cfg.block_size))
    return out


def materialize(x: torch.Tensor, kept: Kept) -> torch.Tensor:
    """Full [B, V] processed logits: x on rows that were not truncated (greedy), the kept scaled logits
    on the others, -inf on dropped tokens."""
    out = x.clone()
    for part in kept.sparse:
        rows = torch.full((part.rows.numel(), x.shape[1]), NEG_INF, dtype=x.dtype, device=x.device)
        out[part.rows] = rows.scatter_(1, part.ids, part.logits)
    if kept.dense is not None:
        out[kept.dense.rows] = kept.dense.logits
    return out
