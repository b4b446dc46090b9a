"""Counter-based noise for the draw: a pure function of (seed, output position, token id).

Every random number the sampler uses is a hash, not a generator stream, so a request draws the same
token whatever batch it is in, whatever row it sits at, and after preemption (DESIGN invariant 5).
The hash is the SplitMix64 finaliser (a bijection on 64-bit words with full avalanche) applied to
int64 tensors, vectorised over every row and candidate in one expression.

torch int64 arithmetic wraps on multiplication and addition (two's complement), which is exactly the
mod-2^64 arithmetic SplitMix64 needs; but `>>` is an arithmetic shift, so each right shift is masked
to make it logical.  `tests/unit/test_sampler_noise.py` checks this against a pure-Python reference.
"""

from __future__ import annotations

import torch

_U64 = 1 << 64


def _i64(c: int) -> int:
    """An unsigned 64-bit constant as the signed int torch stores."""
    return c - _U64 if c >= 1 << 63 else c


GOLDEN = _i64(0x9E3779B97F4A7C15)  # SplitMix64 increment (2^64 / golden ratio, odd)
_M1 = _i64(0xBF58476D1CE4E5B9)
_M2 = _i64(0x94D049BB133111EB)
_M_ID = _i64(0xD6E8FEB86659FD93)  # odd multiplier spreading token / block ids over the word
# Domain separators: the token-level and block-level draws must be independent of each other.
SALT_TOKEN = _i64(0x243F6A8885A308D3)
SALT_BLOCK = _i64(0x13198A2E03707344)
_TWO_POW_M53 = 2.0**-53


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch's >> sign-extends, so clear the top s bits)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser on int64 tensors (returns a new tensor)."""
    z = z ^ _srl(z, 30)
    z.mul_(_M1)
    z ^= _srl(z, 27)
    z.mul_(_M2)
    z ^= _srl(z, 31)
    return z


def seed_key(seed: int) -> int:
    """mix64 of a seed, in Python (done once per request, not per step): hashing the seed first keeps
    nearby seeds (0, 1, 2, ...) from giving correlated streams."""
    z = seed % _U64
    z ^= z >> 30
    z = (z * (_M1 % _U64)) % _U64
    z ^= z >> 27
    z = (z * (_M2 % _U64)) % _U64
    return _i64(z ^ (z >> 31))


def keys_from_seed_keys(seed_keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """row_keys with the seed hash precomputed (SamplingMetadata.seed_keys): one mix64 instead of two."""
    return mix64(seed_keys + (positions.to(torch.int64) + 1) * GOLDEN)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One 64-bit key per (seed, output position), elementwise: mix64(mix64(seed) + (pos + 1) * GOLDEN)."""
    return keys_from_seed_keys(mix64(seeds.to(torch.int64)), positions)


def uniform(keys: torch.Tensor, ids: torch.Tensor, salt: int | torch.Tensor) -> torch.Tensor:
    """U(0, 1) float64 for each (row key, id): keys [R], ids [R, K] -> [R, K], never 0 or 1.
    `salt` (the domain) may be a tensor broadcasting against ids, to hash two domains in one pass."""
    z = mix64(ids * _M_ID + keys.unsqueeze(-1) + salt)
    # The top 53 bits are an exact float64 integer; the +0.5 keeps u strictly inside (0, 1).
    return (_srl(z, 11).to(torch.float64) + 0.5) * _TWO_POW_M53


def gumbel(keys: torch.Tensor, ids: torch.Tensor, salt: int | torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise, float64: argmax(log w + G) draws index i with probability w_i / sum(w)."""
    return uniform(keys, ids, salt).log_().neg_().log_().neg_()
