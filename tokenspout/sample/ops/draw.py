"""The draw: two-level Gumbel-max over fixed vocabulary blocks, never multinomial, never a sort.

Hashing noise for every one of 128k tokens of every row costs ~4 ms per row on this CPU, so the draw
is split in two exact stages over fixed blocks of `block_size` consecutive token ids:

1. pick a block b with probability W_b / sum(W), W_b = sum of the kept weights in block b,
   by argmax_b(log W_b + G(seed, pos, b));
2. pick a token t inside b with probability w_t / W_b, by argmax_t(log w_t + G'(seed, pos, t)).

P(t) = W_b / sum(W) * w_t / W_b = w_t / sum(W): exactly the target distribution, with noise hashed for
~V / block_size blocks plus block_size tokens per row instead of V tokens.  Both stages are Gumbel-max
draws (noise-argmax), and the noise of token t depends only on (seed, pos, t), of block b only on
(seed, pos, b), so the drawn token depends only on the seed, the position and the row's kept
distribution -- not on the batch, the row index, or whether the kept set was found sparse or dense.
"""

from __future__ import annotations

import functools

import torch

from tokenspout.sample.ops.noise import SALT_BLOCK, SALT_TOKEN, gumbel

DEFAULT_BLOCK_SIZE = 256
NEG_INF = float("-inf")


def block_mass(w: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per-block sums of dense weights: w [R, V] -> [R, ceil(V / block_size)].

    The inner sums run over a fixed 256-wide axis, which torch reduces in the same order whatever the
    number of rows (a plain row sum over V does not: it splits long rows across threads)."""
    rows, vocab = w.shape
    full = vocab // block_size
    parts = []
    if full:
        parts.append(w[:, : full * block_size].reshape(rows, full, block_size).sum(-1))
    if vocab % block_size:
        parts.append(w[:, full * block_size :].sum(-1, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def draw_dense(logits: torch.Tensor, mass: torch.Tensor, keys: torch.Tensor, block_size: int) -> torch.Tensor:
    """Draws from dense rows.

    logits [R, V]: scaled logits, -inf where the token is not kept; mass [R, nb]: block_mass of the
    kept weights (any per-row scale: softmax probabilities do); keys [R]: noise keys.  Returns ids [R]."""
    rows, vocab = logits.shape
    nb = mass.shape[1]
    block_score = mass.log() + gumbel(keys, _arange(rows, nb, logits.device), SALT_BLOCK)
    chosen = block_score.argmax(-1, keepdim=True)  # [R, 1]
    ids = chosen * block_size + torch.arange(block_size, device=logits.device)
    inside = ids < vocab  # the last block may be short
    ids = torch.where(inside, ids, 0)
    # Within a block only differences of logits matter, so the row's own scale needs no correction.
    tok_score = logits.gather(1, ids) + gumbel(keys, ids, SALT_TOKEN)
    tok_score.masked_fill_(~inside, NEG_INF)
    return ids.gather(1, tok_score.argmax(-1, keepdim=True)).squeeze(-1)


def draw_sparse(
    ids: torch.Tensor, logits: torch.Tensor, keys: torch.Tensor, vocab: int, block_size: int
) -> torch.Tensor:
    """Draws from candidate rows: ids [R, K] distinct token ids, logits [R, K] scaled logits with -inf
    where not kept (every kept token of the row must be among the candidates).  Returns ids [R]."""
    rows, k = ids.shape
    row_max = logits.amax(-1, keepdim=True)
    # An all -inf row (everything masked) would give NaN weights; its draw is arbitrary but must not crash.
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    w = (logits - row_max).exp_()
    kept = w > 0
    bid = torch.div(ids, block_size, rounding_mode="floor")
    nb = -(-vocab // block_size)
    mass = torch.zeros(rows, nb, dtype=w.dtype, device=w.device).scatter_add_(1, bid, w)
    if k > nb + block_size:
        # Many candidates (a fallback tier): hash per block and per token of the chosen block, as the
        # dense draw does, rather than twice per candidate.  Same noise, so the same token.
        chosen = (mass.log() + gumbel(keys, _arange(rows, nb, ids.device), SALT_BLOCK)).argmax(-1, keepdim=True)
        local = ids - chosen * block_size
        inside = (bid == chosen) & kept
        buf = torch.full((rows, block_size + 1), NEG_INF, dtype=logits.dtype, device=logits.device)
        buf.scatter_(1, torch.where(inside, local, block_size), torch.where(inside, logits, NEG_INF))
        tok_ids = chosen * block_size + torch.arange(block_size, device=ids.device)
        score = buf[:, :block_size] + gumbel(keys, tok_ids.clamp(max=vocab - 1), SALT_TOKEN)
        return tok_ids.gather(1, score.argmax(-1, keepdim=True)).squeeze(-1)
    # Few candidates: hash each candidate's block and the candidate itself, both in one pass.
    g = gumbel(keys, torch.cat([bid, ids], 1), _two_salts(k, ids.device))
    block_score = mass.gather(1, bid).log_().add_(g[:, :k])
    block_score.masked_fill_(~kept, NEG_INF)
    chosen = bid.gather(1, block_score.argmax(-1, keepdim=True))  # [R, 1]
    tok_score = (logits - row_max) + g[:, k:]
    tok_score.masked_fill_(~kept | (bid != chosen), NEG_INF)
    return ids.gather(1, tok_score.argmax(-1, keepdim=True)).squeeze(-1)


@functools.lru_cache(maxsize=64)
def _two_salts(k: int, device: torch.device) -> torch.Tensor:
    """[1, 2k]: SALT_BLOCK for the first k columns, SALT_TOKEN for the rest (cached: built per shape)."""
    return torch.tensor([SALT_BLOCK, SALT_TOKEN], device=device).repeat_interleave(k).unsqueeze(0)


def _arange(rows: int, n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device).expand(rows, n)
