"""The counter-based hash: torch int64 arithmetic equals exact mod-2^64 SplitMix64 in Python."""

from __future__ import annotations

import random

import torch

from tokenspout.sample.ops import noise

MASK64 = (1 << 64) - 1


def py_mix64(z: int) -> int:
    z &= MASK64
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & MASK64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def to_signed(z: int) -> int:
    return z - (1 << 64) if z >= 1 << 63 else z


def test_mix64_matches_python_reference() -> None:
    rng = random.Random(0)
    vals = [0, 1, -1, (1 << 63) - 1, -(1 << 63)] + [rng.randrange(-(1 << 63), 1 << 63) for _ in range(2000)]
    got = noise.mix64(torch.tensor(vals, dtype=torch.int64)).tolist()
    assert got == [to_signed(py_mix64(v)) for v in vals]


def test_uniform_matches_python_reference_and_is_open_interval() -> None:
    rng = random.Random(1)
    seeds = torch.tensor([rng.randrange(1 << 63) for _ in range(8)])
    pos = torch.tensor([rng.randrange(10_000) for _ in range(8)])
    ids = torch.randint(0, 200_000, (8, 50))
    keys = noise.row_keys(seeds, pos)
    assert torch.equal(keys, noise.keys_from_seed_keys(torch.tensor([noise.seed_key(int(s)) for s in seeds]), pos))
    u = noise.uniform(keys, ids, noise.SALT_TOKEN)
    for r in range(8):
        assert noise.seed_key(int(seeds[r])) == to_signed(py_mix64(int(seeds[r])))
        k = py_mix64(py_mix64(int(seeds[r])) + (int(pos[r]) + 1) * 0x9E3779B97F4A7C15)
        assert to_signed(k) == int(keys[r])
        for c in (0, 17, 49):
            z = py_mix64(int(ids[r, c]) * 0xD6E8FEB86659FD93 + k + 0x243F6A8885A308D3)
            assert u[r, c].item() == ((z >> 11) + 0.5) * 2.0**-53
    assert bool(((u > 0) & (u < 1)).all())


def test_noise_is_a_function_of_seed_position_and_id_only() -> None:
    keys = noise.row_keys(torch.tensor([5, 5, 6, 5]), torch.tensor([3, 3, 3, 4]))
    ids = torch.tensor([[10, 11, 12]] * 4)
    g = noise.gumbel(keys, ids, noise.SALT_TOKEN)
    assert torch.equal(g[0], g[1])  # same (seed, pos, id) -> same noise
    assert not torch.equal(g[0], g[2]) and not torch.equal(g[0], g[3])  # other seed / position
    # The same token in another column (another batch layout) gets the same noise.
    g2 = noise.gumbel(keys[:1], torch.tensor([[12, 10]]), noise.SALT_TOKEN)
    assert g2[0, 0] == g[0, 2] and g2[0, 1] == g[0, 0]
    assert not torch.equal(g, noise.gumbel(keys, ids, noise.SALT_BLOCK))  # domains are separate


def test_uniform_moments() -> None:
    keys = noise.row_keys(torch.arange(64), torch.zeros(64, dtype=torch.int64))
    u = noise.uniform(keys, torch.arange(4096).expand(64, 4096), noise.SALT_TOKEN)
    assert abs(u.mean().item() - 0.5) < 0.005
    assert abs(u.var().item() - 1 / 12) < 0.002
    # Adjacent ids and adjacent seeds are uncorrelated.
    assert abs(torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1].item()) < 0.01
    assert abs(torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1].item()) < 0.01
