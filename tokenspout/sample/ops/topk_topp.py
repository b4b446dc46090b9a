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
Z_A comes from C in (a)-(c); in (d) from one dense softmax over the row (no sort).  Rows not covered by
K candidates retry with the larger candidate sets of `later_k` and finally with a full sort (K = V,
trivially covered); rows with neither top-k nor top-p (temperature and maybe min_p) whose min_p set is
not covered are drawn densely.  Coverage is decided per row with a K that depends only on the row's own
top_k, so a row takes the same path, and draws the same token, in any batch.
tests/unit/test_sampler_truncation.py checks every path against a full sort, token for token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from tokenspout.sample.metadata import SamplingMetadata
from tokenspout.sample.ops.candidates import candidates
from tokenspout.sample.ops.draw import DEFAULT_BLOCK_SIZE, block_mass
from tokenspout.sample.ops.knobs import RowKnobs
from tokenspout.sample.ops.nucleus import wide_top_p
from tokenspout.tensors import long_tensor

logger = logging.getLogger(__name__)
NEG_INF = float("-inf")


@dataclass(slots=True)
class SparseKept:
    """Rows whose kept tokens all lie among their candidates."""

    rows: torch.Tensor  # [Rs] rows of the batch
    ids: torch.Tensor  # [Rs, K] candidate token ids (distinct per row)
    logits: torch.Tensor  # [Rs, K] scaled logits, -inf where the token is dropped
    k: int  # the candidate set size that covered these rows (k == V: full sort), for stats and tests


@dataclass(slots=True)
class DenseKept:
    """Rows drawn densely: no top-k / top-p and a min_p set (if any) wider than the candidates, or a
    top-p nucleus too wide for any candidate set (ops/nucleus.py)."""

    rows: torch.Tensor  # [Rd]
    logits: torch.Tensor  # [Rd, V] scaled logits, -inf where dropped
    mass: torch.Tensor  # [Rd, nb] block sums of the kept probabilities
    wide_top_p: bool = False  # for stats and tests


@dataclass(slots=True)
class Kept:
    sparse: list[SparseKept] = field(default_factory=list)
    dense: list[DenseKept] = field(default_factory=list)


@dataclass(slots=True)
class TierConfig:
    first_k: int = 128  # first-pass candidates of rows without top_k (top-k rows take top_k + slack)
    first_cap: int = 1024  # rows with a larger top_k start on the later candidate sets
    # Retries for uncovered rows (wide top-p nuclei): a single-row topk(1024) costs ~0.3 ms on 128k
    # logits, topk(8192) ~1-2 ms, a full sort ~12 ms.
    later_k: tuple[int, ...] = (1024, 8192)
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


def _dense_z(x: torch.Tensor, rows: torch.Tensor, top_ids: torch.Tensor, kn: RowKnobs) -> torch.Tensor:
    """Z_A of `rows` in the candidates' units (the top token weighs 1): sum(p over A) / p_top."""
    every = rows.numel() == x.shape[0]
    xr, t, mp = (x, kn.temperature, kn.min_p) if every else (x[rows], kn.temperature[rows], kn.min_p[rows])
    use_min_p = kn.any_min_p and bool((mp > 0).any())
    _, p = dense_probs(xr, t, mp if use_min_p else None)
    # Without min_p the probabilities sum to 1 by construction: skip the extra pass.  (Block sums, not a
    # row sum: torch splits long row sums across threads differently for different batch sizes.)
    total = block_mass(p, DEFAULT_BLOCK_SIZE).sum(-1) if use_min_p else 1.0
    return total / p.gather(1, top_ids).squeeze(-1)


@dataclass(slots=True)
class _Pending:
    """Rows still looking for a covering candidate set, with what earlier passes learnt about them."""

    rows: torch.Tensor  # batch rows
    x: torch.Tensor  # their logits
    kn: RowKnobs
    z: torch.Tensor  # Z_A from the dense pass, NaN where not computed yet
    need: torch.Tensor  # lower bound on the candidates that can cover the row (float)

    def select(self, idx: torch.Tensor) -> _Pending:
        return _Pending(self.rows[idx], self.x[idx], self.kn.select(idx), self.z[idx], self.need[idx])

    def cat(self, other: _Pending) -> _Pending:
        return _Pending(torch.cat([self.rows, other.rows]), torch.cat([self.x, other.x]), self.kn.cat(other.kn),
                        torch.cat([self.z, other.z]), torch.cat([self.need, other.need]))


def _resolve(
    p: _Pending, k_row: torch.Tensor | None, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One pass over the pending rows with k candidates (row r looks at its first k_row[r]; None: all k).

    Returns (ids, kept logits, covered, plain, retry); `plain` rows have no top-k/top-p and an uncovered
    min_p set (draw them densely), `retry` rows need more candidates.  Updates p.z and p.need."""
    x, kn = p.x, p.kn
    vocab = x.shape[1]
    y, ids = candidates(x, k, kn.temperature)
    m = y[:, :1]
    m = torch.where(m > NEG_INF, m, 0.0)  # an all-masked row: weights 0, not NaN
    w = (y - m).exp_()
    keep = w > 0
    if k_row is None:
        y_last = y[:, -1:]
    else:
        y_last = y.gather(1, (k_row - 1).unsqueeze(-1))
        keep &= torch.arange(y.shape[1], device=y.device) < k_row.unsqueeze(-1)
    w_last = (y_last - m).exp_().squeeze(-1)
    in_c = (w_last == 0) | (k >= vocab)  # (c), or the candidates are the whole row
    if kn.any_min_p:
        keep &= w >= kn.min_p.unsqueeze(-1)
        in_c |= (kn.min_p > 0) & (w_last < kn.min_p)  # (b)
    topk_on = kn.top_k > 0
    if kn.any_top_k:
        # A top_k beyond k_row keeps every candidate strictly above y_last, so it cannot bind inside C.
        fits = topk_on & (kn.top_k <= (k if k_row is None else k_row))
        kth = y.gather(1, (kn.top_k - 1).clamp(0, y.shape[1] - 1).unsqueeze(-1))
        keep &= ~fits.unsqueeze(-1) | (y >= kth)
        in_c |= fits & (kth > y_last).squeeze(-1)  # (a)
    covered = in_c
    need_z = short = None
    if kn.any_top_p:
        wa = w * keep
        z = wa.sum(-1)
        # (d) needs Z over the whole row; with top-k on but not covered, A reaches past C: retry instead.
        need_z = (kn.top_p < 1) & ~in_c & ~topk_on
        if bool(need_z.any()):
            missing = (need_z & p.z.isnan()).nonzero().squeeze(-1)
            if missing.numel():
                p.z[missing] = _dense_z(x, missing, ids[missing, :1], kn)
            z = torch.where(need_z, p.z, z)
        ahead = wa.cumsum(-1) - wa
        keep &= (kn.top_p >= 1).unsqueeze(-1) | (ahead < (kn.top_p * z).unsqueeze(-1))
        above = (wa * (y > y_last)).sum(-1)
        covered = in_c | (need_z & (above >= kn.top_p * z))
        short = kn.top_p * z - above
    plain = ~covered & (kn.top_p >= 1) & ~topk_on
    retry = ~covered & ~plain
    if bool(retry.any()):
        # Lower bounds on the candidates a later pass needs, so that passes which cannot succeed are
        # skipped: a top-k row needs top_k + 1; a top-p row needs the missing mass, and every token
        # outside C weighs at most w_last, so at least (top_p * Z - above) / w_last more candidates.
        need = torch.where(topk_on, (kn.top_k + 1).to(p.need.dtype), p.need)
        if need_z is not None and short is not None:
            more = (short / w_last).nan_to_num_(nan=0.0, posinf=float(vocab))
            need = torch.where(need_z, (k if k_row is None else k_row) + more, need)
        p.need = need
    return ids, y.masked_fill_(~keep, NEG_INF), covered, plain, retry


def _tiers(
    p: _Pending, k_row: torch.Tensor | None, ladder: list[int], out: Kept, block_size: int
) -> list[torch.Tensor]:
    """Resolves every pending row on the candidate ladder; returns the rows to draw densely (plain)."""
    plain_rows = []
    pool: _Pending | None = None
    vocab = p.x.shape[1]
    for tier, k in enumerate(ladder):
        if tier:  # later passes: only the rows whose lower bound fits k (the full sort takes all)
            if pool is None:
                break
            go = torch.ones_like(pool.need, dtype=torch.bool) if k >= vocab else pool.need <= k
            if not bool(go.any()):
                continue
            if bool(go.all()):
                p, pool = pool, None
            else:
                p, pool = pool.select(go.nonzero().squeeze(-1)), pool.select((~go).nonzero().squeeze(-1))
            if k >= 8 * ladder[0]:
                logger.debug("%d rows need %d candidates", p.rows.numel(), k)
        if tier and k >= vocab:
            # Past the last candidate set: top-p rows go to the bucketed nucleus, top-k rows to a full sort.
            wide = p.kn.top_k <= 0
            if bool(wide.any()):
                w = p if bool(wide.all()) else p.select(wide.nonzero().squeeze(-1))
                y, probs = wide_top_p(w.x, w.kn)
                out.dense.append(DenseKept(w.rows, y, block_mass(probs, block_size), wide_top_p=True))
                if w is p:
                    break
                p = p.select((~wide).nonzero().squeeze(-1))
        ids, kept, covered, plain, retry = _resolve(p, None if tier else k_row, k)
        if bool(covered.all()):
            out.sparse.append(SparseKept(p.rows, ids, kept, k))
            continue
        if bool(covered.any()):
            sel = covered.nonzero().squeeze(-1)
            out.sparse.append(SparseKept(p.rows[sel], ids[sel], kept[sel], k))
        if bool(plain.any()):
            plain_rows.append(p.rows[plain])
        if bool(retry.any()):
            again = p.select(retry.nonzero().squeeze(-1))
            pool = again if pool is None else pool.cat(again)
    return plain_rows


def truncate(x: torch.Tensor, meta: SamplingMetadata, cfg: TierConfig,
             only: tuple[list[int], list[int], list[int]] | None = None) -> Kept:
    """The kept distribution (after temperature, min_p, top-k, top-p) of every random row of x [B, V].
    `only`: (truncated rows, their top_k, plain rows) to do instead of all of meta's (subsets of them)."""
    vocab = x.shape[1]
    out = Kept()
    truncated, top_ks, plain = only if only is not None else (meta.truncated_rows, meta.truncated_top_k,
                                                               meta.plain_rows)
    rows = long_tensor(truncated, x.device)
    plain_rows = [long_tensor(plain, x.device)]
    if rows.numel():
        every = rows.numel() == x.shape[0]
        kn = RowKnobs(meta.temperature, meta.top_k, meta.top_p, meta.min_p, meta.any_top_k, meta.any_top_p,
                      meta.any_min_p)
        if not every:
            kn = kn.select(rows)
        # First pass: K per row from its own top_k only, so a row's path never depends on its neighbours.
        # A top-k row needs candidates past the k-th to show the k-th value is not tied with the rest;
        # bf16 logits tie often, so leave room for a tie group rather than retrying with 1024.
        cap = cfg.first_cap
        wanted = [min(vocab, min(cap, k + 16 + k // 4) if 0 < k < cap else cfg.first_k) for k in top_ks]
        first = max(wanted)
        k_row = None if min(wanted) == first else torch.tensor(wanted, device=x.device)
        nan = torch.full((rows.numel(),), float("nan"), device=x.device)
        pending = _Pending(rows, x if every else x.index_select(0, rows), kn, nan, torch.zeros_like(nan))
        ladder = [first] + [k for k in cfg.later_k if first < k < vocab] + ([vocab] if first < vocab else [])
        plain_rows += _tiers(pending, k_row, ladder, out, cfg.block_size)
    # Ascending, so that a full set of rows is the identity.
    dense = plain_rows[0] if len(plain_rows) == 1 else torch.cat(plain_rows).sort().values
    if dense.numel():
        temp = meta.temperature.index_select(0, dense)
        min_p = meta.min_p.index_select(0, dense)
        xd = x if dense.numel() == x.shape[0] else x.index_select(0, dense)
        y, p = dense_probs(xd, temp, min_p if bool((min_p > 0).any()) else None)
        out.dense.append(DenseKept(dense, y, block_mass(p, cfg.block_size)))
    return out


def materialize(x: torch.Tensor, kept: Kept) -> torch.Tensor:
    """Full [B, V] processed logits: x on rows that were not truncated (greedy), the kept scaled logits
    on the others, -inf on dropped tokens."""
    out = x.clone()
    for sparse in kept.sparse:
        rows = torch.full((sparse.rows.numel(), x.shape[1]), NEG_INF, dtype=x.dtype, device=x.device)
        out[sparse.rows] = rows.scatter_(1, sparse.ids, sparse.logits)
    for dense in kept.dense:
        out[dense.rows] = dense.logits
    return out
