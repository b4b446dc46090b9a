"""Rejection sampling for speculative decoding: k drafted tokens in, 1..k+1 tokens out, exactly as if drawn from p.

Strict acceptance (Leviathan et al. 2023, Chen et al. 2023).  At drafted position j with draft token x:
- accept with probability min(1, p(x) / q(x));
- at the first rejection draw from normalize(max(0, p - q)) at that position and stop;
- if every drafted token is accepted, draw a bonus token from p at position num_draft.
Each emitted token is then distributed exactly as p given the tokens before it: P(emit y) =
q(y) min(1, p(y)/q(y)) + (sum_x max(0, q(x) - p(x))) * max(0, p(y) - q(y)) / sum max(0, p - q)
= min(p, q)(y) + max(0, p(y) - q(y)) = p(y), because both sums equal the total variation distance.

N-gram drafts have no q: the draft is a deterministic function of the context, i.e. q is a point mass
on x.  Then the accept probability is p(x) and the residual is p with x removed.  This is exact for any
fixed x (emit x with p(x); emit y != x with (1 - p(x)) p(y) / (1 - p(x))), however x was chosen.

Greedy rows accept while the draft equals argmax p, then emit argmax p at the stop position.

Everything is vectorised over rows and positions: the accept tests of all [B, k] positions are one
comparison; the stop position is a cumprod; only the one position per row where a token is drawn is
gathered ([B, V]), and the draw is the sampler's two-level Gumbel-max over vocabulary blocks (the scheme
of ops/draw.py, with the same noise), so it hashes ~V/256 + 256 noise values per row, never sorts and
never calls torch.multinomial.

Randomness.  Each (row, position j in 0..k) gets a 64-bit key: with seeds, key = row_keys(seed,
output_position + j), the very key the ordinary sampler uses at that output position, so everything a
seeded request draws depends only on (seed, output position, token) -- not on the batch or the row.  With
a torch.Generator (or None: torch's default generator) the keys are drawn from it instead.  From a key:
- the accept uniform is uniform(key, id 0, SALT_ACCEPT);
- the recovery / bonus draw hashes (key, block id, SALT_BLOCK) and (key, token id, SALT_TOKEN).
The hash input is id * M_ID + key + salt, and M_ID is odd (invertible mod 2^64), so the accept input can
only coincide with a token input if t = (SALT_ACCEPT - SALT_TOKEN) / M_ID mod 2^64 (~1.3e19) and with a
block input if b ~ 6.2e18: no real token or block id, so the accept uniform is a different SplitMix64
output from every draw noise value at the same position (tests/unit/test_rejection_sampler.py checks
the arithmetic).  The accept uniform at the stop position and the draw there are hence independent.

A draft *model* must not sample its drafts with these same keys (the recovery draw would then reuse the
noise that chose x, which biases it): give its sampler `draft_seeds(seeds)`.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from tokenspout.sample.ops.draw import DEFAULT_BLOCK_SIZE, block_mass
from tokenspout.sample.ops.noise import SALT_BLOCK, SALT_TOKEN, gumbel, mix64, row_keys, uniform

logger = logging.getLogger(__name__)

SALT_ACCEPT = 0xA4093822299F31D0 - (1 << 64)  # more digits of pi, as the signed int64 torch stores
SALT_DRAFT = 0x082EFA98EC4E6C89  # derives the draft model's seeds from the request's
# A residual mass max(0, p - q) at or below this is rounding, not signal: a rejection there happens with
# probability ~ that mass, so falling back to p moves the output distribution by at most this much (TV).
RESIDUAL_FLOOR = 1e-6

Seeds = tuple[Tensor, Tensor] | torch.Generator | None


def rejection_sample(
    target_probs: Tensor,
    draft_token_ids: Tensor,
    draft_probs: Tensor | None,
    num_draft: Tensor,
    is_greedy: Tensor,
    seeds: Seeds,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    any_greedy: bool | None = None,
    all_greedy: bool | None = None,
    target_argmax: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Verifies drafts against the target and returns (output_token_ids [B, k+1] padded with -1, num_emitted [B]).

    target_probs [B, k+1, V] float32: p at each drafted position and the bonus position (rows beyond
    num_draft[b] + 1 positions are ignored); draft_token_ids [B, k] int64 (padding ignored, may be -1);
    draft_probs [B, k, V] or None for n-gram drafts; num_draft [B] in 0..k; is_greedy [B] bool;
    seeds (seed [B], output_position [B] of the first drafted token), a torch.Generator, or None.
    any_greedy / all_greedy: host-side facts about is_greedy, if the caller has them (saves a device sync).
    target_argmax [B, k+1]: the greedy token at each position, if the caller has it (argmax of the logits
    is what the non-speculative sampler emits; argmax of the float32 probabilities can differ from it when
    two logits round to the same probability).  Default: target_probs.argmax(-1).
    """
    batch, width, vocab = target_probs.shape
    k = width - 1
    if draft_token_ids.shape != (batch, k):
        raise ValueError(f"draft_token_ids must be [{batch}, {k}], got {list(draft_token_ids.shape)}")
    if draft_probs is not None and draft_probs.shape != (batch, k, vocab):
        raise ValueError(f"draft_probs must be [{batch}, {k}, {vocab}], got {list(draft_probs.shape)}")
    dev = target_probs.device
    if any_greedy is None:
        any_greedy = bool(is_greedy.any())
    if all_greedy is None:
        all_greedy = bool(is_greedy.all())

    valid = torch.arange(k, device=dev) < num_draft.unsqueeze(1)  # [B, k]
    draft = torch.where(valid, draft_token_ids, 0)  # padding may be -1: make it a safe index
    argmax = None  # [B, k+1], computed iff some row is greedy
    if any_greedy or all_greedy:
        argmax = target_argmax if target_argmax is not None else target_probs.argmax(-1)
    keys = None if all_greedy else _noise_keys(seeds, batch, width, dev)

    if all_greedy:
        assert argmax is not None
        ok = draft == argmax[:, :k]
    else:
        assert keys is not None
        p_x = target_probs[:, :k].gather(2, draft.unsqueeze(-1)).squeeze(-1).double()
        u = uniform(keys[:, :k].reshape(-1), torch.zeros(batch * k, 1, dtype=torch.int64, device=dev), SALT_ACCEPT)
        u = u.view(batch, k)
        if draft_probs is None:
            ok = u < p_x
        else:
            q_x = draft_probs.gather(2, draft.unsqueeze(-1)).squeeze(-1).double()
            # u < p/q without dividing: q(x) = 0 accepts iff p(x) > 0 (the limit of min(1, p/q)); p(x) = 0
            # never accepts, so a masked token can never be emitted as an accepted draft.
            ok = u * q_x < p_x
        if argmax is not None:
            ok = torch.where(is_greedy.unsqueeze(1), draft == argmax[:, :k], ok)
    ok &= valid
    n_acc = ok.long().cumprod(1).sum(1)  # accepted prefix length = the stop position, in 0..num_draft
    rows = torch.arange(batch, device=dev)

    if all_greedy:
        assert argmax is not None
        final = argmax[rows, n_acc]
    else:
        assert keys is not None
        rejected = n_acc < num_draft  # else the stop position is the bonus position
        # The one position per row that needs a draw, [B, V] (index_select on the flat view: one row copy each).
        p_s = target_probs.reshape(batch * width, vocab).index_select(0, rows * width + n_acc)
        last = n_acc.clamp(max=max(k - 1, 0))
        x_s = draft.gather(1, last.unsqueeze(1)).squeeze(1) if k else n_acc
        q_s = None
        if draft_probs is not None and k:
            q_s = draft_probs.reshape(batch * k, vocab).index_select(0, rows * k + last)
        w, mass, empty = recovery_weights(p_s, q_s, x_s, rejected, block_size)
        key_s = keys.gather(1, n_acc.unsqueeze(1)).squeeze(1)
        final = _draw(w, p_s, empty, mass, key_s, block_size)
        if argmax is not None:
            final = torch.where(is_greedy, argmax[rows, n_acc], final)

    cols = torch.arange(width, device=dev)
    out = torch.cat([draft, draft.new_zeros(batch, 1)], dim=1)
    out = torch.where(cols < n_acc.unsqueeze(1), out, -1)
    out.scatter_(1, n_acc.unsqueeze(1), final.unsqueeze(1))
    return out, n_acc + 1


def recovery_weights(
    p: Tensor, q: Tensor | None, x: Tensor, rejected: Tensor, block_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """What each row draws from at its stop position: (w [B, V], mass [B, nb], empty [B, 1] bool).

    w: unnormalised weights (the draw needs no normalisation): on rejected rows max(0, p - q), or p without
    x for n-gram drafts (q = None); on the others (bonus, no drafts) p.  empty: rows whose residual is
    numerically empty (RESIDUAL_FLOOR); they draw from p instead, which _draw reads only at the 256 ids it
    looks at, so the fallback never costs a [B, V] pass.  mass: block sums of what the row draws from.
    The emptiness test sums block sums (a fixed-shape reduction), so it is decided alike in any batch."""
    if q is None:
        kept_x = torch.where(rejected, 0.0, p.gather(1, x.unsqueeze(1)).squeeze(1))
        w = p.scatter(1, x.unsqueeze(1), kept_x.unsqueeze(1))
    else:
        w = torch.where(rejected.unsqueeze(1), p - q, p).clamp_(min=0.0)
    mass = block_mass(w, block_size)
    empty = mass.sum(-1, keepdim=True) <= RESIDUAL_FLOOR
    return w, torch.where(empty, block_mass(p, block_size), mass), empty


def _draw(w: Tensor, p: Tensor, empty: Tensor, mass: Tensor, keys: Tensor, block_size: int) -> Tensor:
    """Two-level Gumbel-max draw [B] from weights w (p on `empty` rows) with block sums `mass`.

    The same noise, stage for stage, as ops/draw.py's draw_dense (block b: gumbel(key, b, SALT_BLOCK);
    token t of the chosen block: gumbel(key, t, SALT_TOKEN)), so a row without drafts draws the token the
    ordinary sampler draws.  draw_dense itself wants log-weights over the whole vocabulary, and the log of
    a [B, V] residual would cost more than all the rest; here only the chosen block's weights are logged."""
    rows, vocab = w.shape
    nb = mass.shape[1]
    block_ids = torch.arange(nb, device=w.device).expand(rows, nb)
    chosen = (mass.log() + gumbel(keys, block_ids, SALT_BLOCK)).argmax(-1, keepdim=True)
    ids = chosen * block_size + torch.arange(block_size, device=w.device)
    inside = ids < vocab  # the last block may be short
    ids = torch.where(inside, ids, 0)
    weights = torch.where(empty, p.gather(1, ids), w.gather(1, ids))
    score = weights.log_() + gumbel(keys, ids, SALT_TOKEN)
    score.masked_fill_(~inside, float("-inf"))
    return ids.gather(1, score.argmax(-1, keepdim=True)).squeeze(-1)


def _noise_keys(seeds: Seeds, batch: int, width: int, device: torch.device) -> Tensor:
    """One 64-bit noise key per (row, position) [B, width]."""
    if isinstance(seeds, tuple):
        seed, first_pos = seeds
        pos = first_pos.to(torch.int64).unsqueeze(1) + torch.arange(width, device=device)
        return row_keys(seed.to(torch.int64).unsqueeze(1), pos)
    return torch.randint(-(2**63), 2**63 - 1, (batch, width), generator=seeds, dtype=torch.int64, device=device)


def draft_seeds(seeds: Tensor) -> Tensor:
    """Seeds [B] for a draft model's own sampler: a different 63-bit stream per request, so the drafts'
    noise is independent of the noise rejection_sample uses at the same output positions."""
    return mix64(seeds.to(torch.int64) ^ SALT_DRAFT) & ((1 << 63) - 1)


def probs_from_logits(processed_logits: Tensor) -> Tensor:
    """Softmax in float32 over the last axis of processed logits (compute_processed_logits' output,
    -inf where dropped).  A row with every token dropped gives zeros instead of NaN."""
    return torch.softmax(processed_logits.float(), dim=-1).nan_to_num_(0.0)


def pad_positions(flat: Tensor, num_draft: Tensor, k: int) -> Tensor:
    """Per-position rows in the model runner's flat layout [sum(num_draft + 1), ...] (each request's
    num_draft[b] drafted positions then its bonus position, requests in order) -> padded [B, k+1, ...],
    zeros beyond num_draft[b] + 1."""
    counts = num_draft + 1
    starts = torch.cumsum(counts, 0) - counts
    cols = torch.arange(k + 1, device=flat.device)
    inside = cols < counts.unsqueeze(1)
    idx = torch.where(inside, starts.unsqueeze(1) + cols, 0)
    out = flat[idx]
    mask = inside.view(*inside.shape, *([1] * (flat.dim() - 1)))
    return out.masked_fill_(~mask, 0)


def pack_drafts(drafts: list[list[int]], k: int, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Proposer output (up to k ids per request) -> (draft_token_ids [B, k] padded with -1, num_draft [B])."""
    ids = torch.full((len(drafts), k), -1, dtype=torch.int64)
    for b, d in enumerate(drafts):  # host-side packing of host-side lists; one copy to the device after
        if d:
            ids[b, : len(d)] = torch.tensor(d[:k], dtype=torch.int64)
    num = torch.tensor([min(len(d), k) for d in drafts], dtype=torch.int64)
    return ids.to(device), num.to(device)


def accepted_lengths(num_emitted: Tensor, num_draft: Tensor) -> Tensor:
    """Accepted draft tokens per row [B] (num_emitted - 1, in 0..num_draft): acceptance rate for metrics is
    accepted_lengths(...).sum() / num_draft.sum()."""
    return torch.minimum(num_emitted - 1, num_draft).clamp_(min=0)
