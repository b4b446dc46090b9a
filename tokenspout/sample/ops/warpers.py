"""The further warpers: top-n-sigma, dynamic temperature, typical-p, epsilon, eta and XTC, per row.

Where they sit in the sampler's order (DESIGN invariant 2; README "Sampling parameters"):
  ... penalties -> greedy argmax -> top_n_sigma -> temperature (dynatemp: entropy-scaled) -> min_p -> top-k / top-p
  -> typical_p -> epsilon_cutoff -> eta_cutoff -> XTC -> draw.
Each one works on the renormalised survivors of the steps before it, as transformers' warpers do when chained.

- top_n_sigma (llama.cpp's llama_sampler_top_n_sigma): keep logits >= max - n * std, the population standard
  deviation over the row's finite logits.  Scaling by 1/T scales max and std alike, so the kept set does not depend
  on the temperature: it runs on the logits before temperature, like llama.cpp (which applies temperature last).
- dynatemp (llama.cpp's llama_sampler_temp_ext): T_dyn = T_min + (T_max - T_min) * (H / log N) ** exponent, with
  T_min = max(0, T - range), T_max = T + range, H the entropy of softmax(logits) over the N tokens still in the
  running: the finite logits after top_n_sigma and, on a row with top-k, its top-k candidates (ties at the k-th
  value included).  llama.cpp runs it last in its chain, on the candidates its top-k / top-p / min-p left (all
  taken at temperature 1); here min_p / top-p come after the temperature (vLLM's order), so they cannot be in front
  of it, but top-k does not depend on the temperature and is: its entropy then costs k values, not a vocabulary
  pass.  It replaces the row's temperature at the temperature's place.
- typical_p, epsilon_cutoff, eta_cutoff: transformers' TypicalLogitsWarper / EpsilonLogitsWarper / EtaLogitsWarper
  (min_tokens_to_keep = 1), in generate()'s order (typical, epsilon, eta, after top-k / top-p / min_p).
- XTC (llama.cpp's llama_sampler_xtc): with probability xtc_probability per step, if at least two tokens have
  p >= xtc_threshold, drop every one of them except the least likely (tokens tied at that least value all stay;
  llama.cpp keeps one of a tie in its sort order).  The coin is the row's own counter-based noise (seed, position,
  a salt of its own), so seeded rows stay batch-invariant.

Rows are [R, K] scaled logits with -inf where dropped: either candidate sets (a top-k / top-p row's kept tokens all
lie among its candidates, topk_topp.py) or whole rows [R, V].  typical_p orders the kept tokens by |-log p - H|:
on a candidate set that is a sort of K values; on a whole row (no top-k / top-p in front of it) the cut is found
from bucketed sums of the row's mass instead (no vocabulary sort).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenspout.sample.ops.noise import keys_from_seed_keys, uniform
from tokenspout.sampling_params import GREEDY_EPS

NEG_INF = float("-inf")
SALT_XTC = 0x2B7E151628AED2A6  # the XTC coin's domain (not the draw's block / token salts)
NEUTRAL = (1.0, 0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 1.0)  # WarpBatch.build's knob order, every one off


@dataclass(slots=True)
class WarpBatch:
    """The rows using any warper (random rows only), their knobs [W] and host flags that skip whole steps."""

    rows: list[int]  # batch rows, ascending
    typical_p: torch.Tensor  # float32, 1 = off
    epsilon: torch.Tensor  # 0 = off
    eta: torch.Tensor  # 0 = off
    top_n_sigma: torch.Tensor  # 0 = off
    xtc_probability: torch.Tensor  # 0 = off
    xtc_threshold: torch.Tensor
    dynatemp_range: torch.Tensor  # 0 = off
    dynatemp_exponent: torch.Tensor
    any_typical: bool
    any_epsilon: bool
    any_eta: bool
    any_sigma: bool
    any_xtc: bool
    any_dynatemp: bool
    knobs: list[tuple[float, ...]]  # the host copy, row by row (subsets and the kernel's table are built from it)

    @staticmethod
    def build(rows: list[int], knobs: list[tuple[float, ...]], device: torch.device) -> WarpBatch:
        """knobs[i]: row i's (typical_p, epsilon, eta, top_n_sigma, xtc_probability, xtc_threshold, dynatemp_range,
        dynatemp_exponent)."""
        t = torch.tensor(knobs, dtype=torch.float32).t().contiguous().to(device)
        typ, eps, eta, sig, xp, xt, dr, de = t.unbind(0)
        return WarpBatch(rows, typ, eps, eta, sig, xp, xt, dr, de,
                         any(k[0] < 1 for k in knobs), any(k[1] > 0 for k in knobs), any(k[2] > 0 for k in knobs),
                         any(k[3] > 0 for k in knobs), any(k[4] > 0 and k[5] <= 0.5 for k in knobs),
                         any(k[6] > 0 for k in knobs), knobs)

    def without(self, rows: set[int]) -> WarpBatch | None:
        """This batch less `rows` (those the CPU kernel draws), None when nothing is left."""
        keep = [i for i, r in enumerate(self.rows) if r not in rows]
        if len(keep) == len(self.rows):
            return self
        if not keep:
            return None
        return WarpBatch.build([self.rows[i] for i in keep], [self.knobs[i] for i in keep], self.typical_p.device)

    def table(self, num_rows: int) -> torch.Tensor:
        """[num_rows, 8] float32 knobs per batch row for the CPU kernel (neutral on rows not in this batch)."""
        t = torch.tensor([NEUTRAL] * num_rows, dtype=torch.float32)
        t[torch.tensor(self.rows, dtype=torch.int64)] = torch.tensor(self.knobs, dtype=torch.float32)
        return t


def _entropy(y: torch.Tensor) -> torch.Tensor:
    """Entropy [R] of softmax(y) over the finite entries (0 * log 0 counted as 0)."""
    logp = y.log_softmax(-1)
    return -(logp.exp() * logp).nan_to_num_(nan=0.0).sum(-1)


def top_n_sigma(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """x [R, V] logits with logits below max - n * std (over the finite ones, population std) set to -inf."""
    finite = torch.isfinite(x)
    cnt = finite.sum(-1, keepdim=True).clamp(min=1)
    xf = torch.where(finite, x, 0.0)
    mean = xf.sum(-1, keepdim=True) / cnt
    var = (torch.where(finite, x - mean, 0.0) ** 2).sum(-1, keepdim=True) / cnt
    bound = x.amax(-1, keepdim=True) - n.unsqueeze(-1) * var.sqrt()
    return x.masked_fill(x < bound, NEG_INF)


def top_k_candidates(x: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """x [R, V] with every logit below the row's k-th largest set to -inf (ties at the k-th value stay, as top-k
    keeps them); rows with top_k 0 (off) unchanged."""
    k = top_k.clamp(min=0, max=x.shape[1])
    if not bool((k > 0).any()):
        return x
    kmax = int(k.max())
    kth = x.topk(kmax, -1).values.gather(1, (k.clamp(min=1) - 1).unsqueeze(-1))
    return torch.where((k > 0).unsqueeze(-1) & (x < kth), NEG_INF, x)


def dynatemp(x: torch.Tensor, temperature: torch.Tensor, rng: torch.Tensor, exponent: torch.Tensor,
             top_k: torch.Tensor | None = None) -> torch.Tensor:
    """The entropy-scaled temperature [R] of rows x [R, V] (logits before any temperature), the entropy over each
    row's top-k candidates where top_k [R] > 0."""
    if top_k is not None:
        x = top_k_candidates(x, top_k)
    n = torch.isfinite(x).sum(-1)
    h_max = n.clamp(min=2).to(torch.float32).log()
    norm = (_entropy(x) / h_max).clamp(0.0, 1.0)
    lo = (temperature - rng).clamp(min=0.0)
    hi = temperature + rng
    t = lo + (hi - lo) * norm.pow(exponent)
    # One finite logit: llama.cpp leaves the row as it is (any temperature draws that token).
    return torch.where(n > 1, t, temperature).clamp(min=GREEDY_EPS)


SORT_MAX = 4096  # typical(): rows up to this wide sort their scores; wider ones (whole rows) bucket them


def typical(y: torch.Tensor, mass: torch.Tensor, buckets: bool | None = None) -> torch.Tensor:
    """Keep mask [R, K]: the tokens whose |-log p - H| is at most the smallest value v at which the mass of
    {|-log p - H| <= v} reaches `mass` (TypicalLogitsWarper: sort ascending, cut where the cumulative mass first
    reaches `mass`; ties at that value all stay, whatever order the sort left them in).  `buckets`: find v without
    sorting the row (default: for rows wider than SORT_MAX, i.e. whole vocabularies)."""
    logp = y.log_softmax(-1)
    p = logp.exp()
    h = -(p * logp).nan_to_num_(nan=0.0).sum(-1, keepdim=True)
    s = (-logp - h).abs()  # +inf where dropped
    if buckets if buckets is not None else y.shape[1] > SORT_MAX:
        return s <= _weighted_quantile(s, p, mass)
    s_sorted, order = s.sort(-1)
    cum = p.gather(1, order).cumsum(-1)
    last = (cum < mass.unsqueeze(-1)).sum(-1, keepdim=True).clamp_(max=s.shape[1] - 1)
    return s <= s_sorted.gather(1, last)


def _weighted_quantile(s: torch.Tensor, p: torch.Tensor, mass: torch.Tensor, shift: int = 16) -> torch.Tensor:
    """[R, 1]: the smallest s value v with sum(p[s <= v]) >= mass (the largest finite s if rounding never gets
    there), without sorting the row -- nucleus.py's method on s instead of p: for s >= 0 the float32 bit pattern is
    monotone in s, so buckets `bits >> shift` are ordered like s; the bucket where the cumulative mass reaches the
    target is found from per-bucket sums, and only its few tokens are ordered."""
    finite = torch.isfinite(s) & (p > 0)
    s0 = torch.where(finite, s, 0.0)
    key = (s0.view(torch.int32) >> shift).to(torch.int64)
    nb = int(key.max()) + 1
    w = torch.where(finite, p, 0.0)
    bmass = torch.zeros(s.shape[0], nb, dtype=p.dtype, device=p.device).scatter_add_(1, key, w)
    cum = bmass.cumsum(-1)
    target = mass.unsqueeze(-1).to(cum.dtype)
    b = (cum < target).sum(-1, keepdim=True).clamp_(max=nb - 1)  # the boundary bucket
    below = torch.where(b > 0, cum.gather(1, (b - 1).clamp(min=0)), 0.0)
    inside = finite & (key == b)
    width = max(int(torch.count_nonzero(inside, dim=-1).max()), 1)
    vals, ids = torch.where(inside, s, float("inf")).topk(width, -1, largest=False)  # ascending
    run = below + p.gather(1, ids).masked_fill_(~torch.isfinite(vals), 0.0).cumsum(-1)
    j = (run < target).sum(-1, keepdim=True).clamp_(max=width - 1)
    v = vals.gather(1, j)
    # A boundary past every finite token (rounding kept the mass below the target): keep them all.
    top = torch.where(finite, s, float("-inf")).amax(-1, keepdim=True)
    return torch.where(torch.isfinite(v), v, top)


def _cutoff(y: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Keep mask: p >= bound [R], and always the most likely token (min_tokens_to_keep = 1)."""
    p = y.softmax(-1)
    return (p >= bound.unsqueeze(-1)) | (y >= y.amax(-1, keepdim=True))


def epsilon(y: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    return _cutoff(y, eps)


def eta(y: torch.Tensor, eta_: torch.Tensor) -> torch.Tensor:
    """EtaLogitsWarper: the bound is min(eta, sqrt(eta) * exp(-H))."""
    return _cutoff(y, torch.minimum(eta_, eta_.sqrt() * torch.exp(-_entropy(y))))


def xtc(y: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Keep mask of XTC applied (the coin already came up): tokens with p >= threshold, all but the least likely,
    are dropped when there are at least two of them."""
    p = y.softmax(-1)
    above = p >= threshold.unsqueeze(-1)
    least = torch.where(above, p, 2.0).amin(-1, keepdim=True)
    act = above.sum(-1, keepdim=True) >= 2
    return ~(act & above & (p > least))


def xtc_coin(seed_keys: torch.Tensor, positions: torch.Tensor, probability: torch.Tensor) -> torch.Tensor:
    """[R] bool: whether XTC acts this step, from the row's own counter-based noise (llama.cpp: chance <= p)."""
    keys = keys_from_seed_keys(seed_keys, positions)
    u = uniform(keys, torch.zeros_like(keys).unsqueeze(-1), SALT_XTC).squeeze(-1)
    return u < probability.double()


def pre_truncation(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, wb: WarpBatch) -> torch.Tensor:
    """top_n_sigma on the warped rows of x [B, V] (in place), and the batch's temperature [B] with the dynatemp
    rows' replaced (a new tensor when any; the caller's otherwise); top_k [B] the batch's (0 = off)."""
    # (Advanced indexing, not index_select: the latter is very slow on whole [R, V] CPU rows.)
    rows = torch.tensor(wb.rows, dtype=torch.int64, device=x.device)
    if wb.any_sigma:
        on = (wb.top_n_sigma > 0).nonzero().squeeze(-1)
        r = rows[on]
        x[r] = top_n_sigma(x[r], wb.top_n_sigma[on])
    if wb.any_dynatemp:
        on = (wb.dynatemp_range > 0).nonzero().squeeze(-1)
        r = rows[on]
        t = dynatemp(x[r], temperature[r], wb.dynatemp_range[on], wb.dynatemp_exponent[on], top_k[r])
        temperature = temperature.index_copy(0, r, t)
    return temperature


def post_truncation(y: torch.Tensor, wb: WarpBatch, idx: torch.Tensor, seed_keys: torch.Tensor,
                    positions: torch.Tensor) -> torch.Tensor:
    """typical, epsilon, eta and XTC on kept rows y [R, K] (scaled logits, -inf where dropped) whose knobs are wb's
    rows `idx` [R]; seed_keys / positions [R] are theirs (the XTC coin).  Returns y with the drops set to -inf."""
    def off(keep: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
        return keep | ~on.unsqueeze(-1)

    if wb.any_typical:
        m = wb.typical_p.index_select(0, idx)
        if bool((m < 1).any()):
            y = y.masked_fill(~off(typical(y, m), m < 1), NEG_INF)
    if wb.any_epsilon:
        e = wb.epsilon.index_select(0, idx)
        if bool((e > 0).any()):
            y = y.masked_fill(~off(epsilon(y, e), e > 0), NEG_INF)
    if wb.any_eta:
        e = wb.eta.index_select(0, idx)
        if bool((e > 0).any()):
            y = y.masked_fill(~off(eta(y, e), e > 0), NEG_INF)
    if wb.any_xtc:
        prob, thr = wb.xtc_probability.index_select(0, idx), wb.xtc_threshold.index_select(0, idx)
        on = (prob > 0) & (thr <= 0.5) & xtc_coin(seed_keys, positions, prob)
        if bool(on.any()):
            y = y.masked_fill(~off(xtc(y, thr), on), NEG_INF)
    return y

