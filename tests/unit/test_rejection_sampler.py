"""Rejection sampler: greedy semantics, edge cases, shapes, padding, seeded batch invariance, helpers.

The distributional exactness is in tests/stats/test_rejection_stats.py."""

from __future__ import annotations

import pytest
import torch

from tokenspout.sample import rejection_sampler as rs
from tokenspout.sample.ops import noise
from tokenspout.sample.rejection_sampler import (
    RESIDUAL_FLOOR,
    SALT_ACCEPT,
    accepted_lengths,
    draft_seeds,
    pack_drafts,
    pad_positions,
    probs_from_logits,
    recovery_weights,
    rejection_sample,
)
from tokenspout.sample.sampler import Sampler, compute_processed_logits
from tokenspout.sampling_params import SamplingParams
from tokenspout.worker.sampling_state import build_metadata

V = 10
K = 3


def point_masses(ids: list[list[int]], vocab: int = V) -> torch.Tensor:
    """target_probs [B, len, V] with p = a point mass on ids[b][j]."""
    p = torch.zeros(len(ids), len(ids[0]), vocab)
    p.scatter_(2, torch.tensor(ids).unsqueeze(-1), 1.0)
    return p


def peaked(argmax: list[list[int]], vocab: int = V, seed: int = 0) -> torch.Tensor:
    """Random full-support distributions whose argmax at [b, j] is argmax[b][j]."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(argmax), len(argmax[0]), vocab, generator=g)
    logits.scatter_(2, torch.tensor(argmax).unsqueeze(-1), 10.0)
    return logits.softmax(-1)


def seeds_for(batch: int, base: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(batch, dtype=torch.int64) + base, torch.full((batch,), 7, dtype=torch.int64)


def t(x: list) -> torch.Tensor:
    return torch.tensor(x)


# ---------------------------------------------------------------- greedy


def test_greedy_accepts_matching_prefix_then_emits_argmax():
    am = [[3, 5, 1, 7], [3, 5, 1, 7], [3, 5, 1, 7], [3, 5, 1, 7], [3, 5, 1, 7]]
    p = peaked(am)
    drafts = t([[3, 5, 2], [3, 5, 1], [4, 5, 1], [3, 5, 0], [9, 9, 9]])
    num = t([3, 3, 3, 2, 0])
    greedy = torch.ones(5, dtype=torch.bool)
    out, n = rejection_sample(p, drafts, None, num, greedy, None)
    assert out.tolist() == [
        [3, 5, 1, -1],  # mismatch at 2: argmax there
        [3, 5, 1, 7],  # all accepted: bonus argmax at position 3
        [3, -1, -1, -1],  # mismatch at 0
        [3, 5, 1, -1],  # num_draft 2, both accepted: bonus argmax at position 2
        [3, -1, -1, -1],  # no drafts: argmax of p[:, 0]
    ]
    assert n.tolist() == [3, 4, 1, 3, 1]


def test_greedy_ignores_draft_probs_and_mixes_with_random_rows():
    am = [[2, 4, 6, 8]] * 4
    p = peaked(am, seed=1)
    q = torch.full((4, K, V), 1.0 / V)
    drafts = t([[2, 4, 6], [2, 4, 6], [2, 9, 6], [2, 9, 6]])
    num = t([3, 3, 3, 3])
    greedy = t([True, False, True, False])
    out, n = rejection_sample(p, drafts, q, num, greedy, seeds_for(4))
    assert out[0].tolist() == [2, 4, 6, 8] and n[0] == 4
    assert out[2].tolist() == [2, 4, -1, -1] and n[2] == 2
    # The same greedy rows on their own (the all-greedy path, no noise at all) agree.
    g_out, g_n = rejection_sample(p[[0, 2]], drafts[[0, 2]], q[[0, 2]], num[[0, 2]], t([True, True]), None)
    assert torch.equal(g_out, out[[0, 2]]) and torch.equal(g_n, n[[0, 2]])


def test_greedy_uses_the_callers_argmax_when_given():
    # Tokens 1 and 2 tie in p (as two close logits can after softmax rounding); the logits' argmax is 2.
    p = torch.zeros(1, 2, V)
    p[0, :, 1] = p[0, :, 2] = 0.5
    draft, num, greedy = t([[2]]), t([1]), t([True])
    out, _ = rejection_sample(p, draft, None, num, greedy, None)
    assert out.tolist() == [[1, -1]]  # p's argmax: the lowest tied id
    out, _ = rejection_sample(p, draft, None, num, greedy, None, target_argmax=t([[2, 2]]))
    assert out.tolist() == [[2, 2]]


def test_greedy_rejects_a_zero_probability_draft():
    p = point_masses([[1, 2, 3, 4]])
    out, n = rejection_sample(p, t([[0, 2, 3]]), None, t([3]), t([True]), None)
    assert out.tolist() == [[1, -1, -1, -1]] and n.tolist() == [1]


# ---------------------------------------------------------------- random rows: edge cases


def test_all_rejected_when_drafts_have_zero_target_probability():
    batch = 400
    g = torch.Generator().manual_seed(3)
    p = torch.rand(batch, K + 1, V, generator=g)
    p[:, :, :3] = 0.0  # tokens 0..2 are masked (top-k / grammar) everywhere
    p /= p.sum(-1, keepdim=True)
    drafts = torch.randint(0, 3, (batch, K), generator=g)
    for q in (None, torch.full((batch, K, V), 1.0 / V)):
        out, n = rejection_sample(p, drafts, q, torch.full((batch,), K), torch.zeros(batch, dtype=torch.bool),
                                  seeds_for(batch))
        assert (n == 1).all()
        assert (out[:, 0] >= 3).all(), "a masked token was emitted"
        assert (out[:, 1:] == -1).all()


def test_all_accepted_emits_drafts_and_the_bonus_from_p_at_num_draft():
    # p == q at drafted positions: min(1, p/q) = 1, so every draft is accepted; p at the bonus
    # position (which is num_draft, not k) is a point mass, so the bonus is known.
    batch = 64
    g = torch.Generator().manual_seed(4)
    p = torch.rand(batch, K + 1, V, generator=g)
    p /= p.sum(-1, keepdim=True)
    num = torch.arange(batch) % (K + 1)
    bonus = torch.arange(batch) % V
    p[torch.arange(batch), num] = torch.nn.functional.one_hot(bonus, V).float()
    drafts = torch.randint(0, V, (batch, K), generator=g)
    out, n = rejection_sample(p, drafts, p[:, :K].clone(), num, torch.zeros(batch, dtype=torch.bool),
                              seeds_for(batch))
    assert torch.equal(n, num + 1)
    for b in range(batch):
        m = int(num[b])
        assert out[b, :m].tolist() == drafts[b, :m].tolist()
        assert out[b, m] == bonus[b]
        assert (out[b, m + 1 :] == -1).all()


def test_ngram_point_mass_target_always_accepts():
    p = point_masses([[4, 5, 6, 7], [4, 5, 6, 7]])
    out, n = rejection_sample(p, t([[4, 5, 6], [4, 5, 0]]), None, t([3, 3]), t([False, False]), seeds_for(2))
    assert out.tolist() == [[4, 5, 6, 7], [4, 5, 6, -1]]
    assert n.tolist() == [4, 3]


def test_variable_num_draft_padding_and_minus_one_draft_padding():
    batch = 8
    g = torch.Generator().manual_seed(5)
    p = torch.rand(batch, K + 1, V, generator=g).softmax(-1)
    num = t([0, 1, 2, 3, 0, 3, 1, 2])
    drafts = torch.randint(0, V, (batch, K), generator=g)
    drafts[torch.arange(K) >= num.unsqueeze(1)] = -1  # the proposer's padding
    for q in (None, torch.rand(batch, K, V, generator=g).softmax(-1)):
        out, n = rejection_sample(p, drafts, q, num, torch.zeros(batch, dtype=torch.bool), seeds_for(batch))
        assert out.shape == (batch, K + 1)
        assert ((n >= 1) & (n <= num + 1)).all()
        cols = torch.arange(K + 1)
        assert ((out == -1) == (cols >= n.unsqueeze(1))).all(), "-1 exactly beyond num_emitted"
        assert ((out >= 0) & (out < V) | (out == -1)).all()
        for b in range(batch):  # the accepted prefix is the drafts themselves
            acc = int(n[b]) - 1
            assert out[b, :acc].tolist() == drafts[b, :acc].tolist()


def test_k_zero_batch_is_ordinary_sampling():
    p = point_masses([[3], [8]])
    out, n = rejection_sample(p, torch.zeros(2, 0, dtype=torch.int64), None, t([0, 0]), t([False, True]),
                              seeds_for(2))
    assert out.tolist() == [[3], [8]] and n.tolist() == [1, 1]


def test_num_draft_zero_rows_draw_exactly_what_the_sampler_draws():
    """A seeded row without drafts uses the sampler's own noise keys and draw: the same token."""
    vocab, batch = 3000, 64
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(6)) * 3
    params = [SamplingParams(temperature=0.8, top_p=0.9 if i % 2 else 1.0, top_k=50 if i % 3 == 0 else 0, seed=i)
              for i in range(batch)]
    meta = build_metadata(params, vocab)
    expected = Sampler()(logits.clone(), meta).sampled_token_ids
    p = probs_from_logits(compute_processed_logits(logits, meta)).unsqueeze(1)
    out, _ = rejection_sample(p, torch.zeros(batch, 0, dtype=torch.int64), None,
                              torch.zeros(batch, dtype=torch.int64), meta.is_greedy, (meta.seeds, meta.positions))
    assert torch.equal(out[:, 0], expected)


def test_q_zero_guard():
    # q(x) = 0 for the drafted x: p(x) > 0 accepts (min(1, p/0) = 1), p(x) = 0 rejects; no NaN anywhere.
    p = torch.zeros(2, 2, V)
    p[:, 0, 1] = 0.5
    p[:, 0, 2] = 0.5
    p[:, 1, 4] = 1.0
    q = torch.zeros(2, 1, V)
    q[:, 0, 7] = 1.0
    out, n = rejection_sample(p, t([[1], [3]]), q, t([1, 1]), t([False, False]), seeds_for(2))
    assert out[0].tolist() == [1, 4] and n[0] == 2
    assert n[1] == 1 and out[1, 0] in (1, 2)


def test_masked_tokens_never_emitted_even_when_q_prefers_them():
    batch = 3000
    g = torch.Generator().manual_seed(8)
    p = torch.rand(batch, K + 1, V, generator=g)
    p[..., 5:] = 0.0  # top-k = 5
    p /= p.sum(-1, keepdim=True)
    q = torch.rand(batch, K, V, generator=g)
    q[..., 5:] *= 50  # the draft loves the masked tokens
    q /= q.sum(-1, keepdim=True)
    drafts = (q.view(-1, V) / torch.empty(batch * K, V).exponential_(generator=g)).argmax(-1).view(batch, K)
    out, n = rejection_sample(p, drafts, q, torch.full((batch,), K), torch.zeros(batch, dtype=torch.bool), g)
    emitted = out[out >= 0]
    assert emitted.numel() == int(n.sum()) and (emitted < 5).all()


def test_residual_fallback_when_p_equals_q():
    p = torch.tensor([[0.25, 0.25, 0.5, 0.0]])
    for q in (p.clone(), p + torch.tensor([[RESIDUAL_FLOOR / 4, -RESIDUAL_FLOOR / 4, 0.0, 0.0]])):
        _, mass, empty = recovery_weights(p, q, t([0]), t([True]), 2)
        assert empty.tolist() == [[True]] and torch.allclose(mass, torch.tensor([[0.5, 0.5]]))
    # A real residual is used as is; the bonus / no-draft rows use p.
    q = torch.tensor([[0.5, 0.25, 0.25, 0.0]])
    w, mass, empty = recovery_weights(p, q, t([0]), t([True]), 2)
    assert torch.allclose(w, torch.tensor([[0.0, 0.0, 0.25, 0.0]])) and not empty.any()
    assert torch.allclose(mass, torch.tensor([[0.0, 0.25]]))
    w, _, empty = recovery_weights(p, q, t([0]), t([False]), 2)
    assert torch.equal(w, p) and not empty.any()
    # n-gram: p without the rejected token; if that is all p had, fall back to p.
    w, _, _ = recovery_weights(p, None, t([2]), t([True]), 2)
    assert w.tolist() == [[0.25, 0.25, 0.0, 0.0]]
    one = torch.tensor([[0.0, 1.0]])
    _, mass, empty = recovery_weights(one, None, t([1]), t([True]), 2)
    assert empty.all() and mass.tolist() == [[1.0]]


def test_empty_residual_draws_from_p_end_to_end():
    """A rejection with nothing left in max(0, p - q) (here p = q / 2, as rounding or a p that does not sum to
    1 can give): the token is drawn from p, and never a token p excludes."""
    batch = 400
    q = torch.zeros(batch, 1, V)
    q[:, 0, 3] = 0.25
    q[:, 0, 6] = 0.75
    p = torch.cat([q / 2, q], 1)
    out, n = rejection_sample(p, torch.full((batch, 1), 3), q, torch.ones(batch, dtype=torch.int64),
                              torch.zeros(batch, dtype=torch.bool), seeds_for(batch))
    rejected = n == 1
    assert 100 < int(rejected.sum()) < 300  # accept probability p(3) / q(3) = 1/2
    tokens = out[rejected, 0]
    assert set(tokens.tolist()) == {3, 6}


def test_no_multinomial_no_sort(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("forbidden on the hot path")

    for name in ("multinomial", "sort", "topk", "argsort"):
        monkeypatch.setattr(torch, name, boom)
        monkeypatch.setattr(torch.Tensor, name, boom)
    batch = 16
    p = torch.rand(batch, K + 1, V).softmax(-1)
    q = torch.rand(batch, K, V).softmax(-1)
    drafts = torch.randint(0, V, (batch, K))
    greedy = torch.arange(batch) % 3 == 0
    rejection_sample(p, drafts, q, torch.full((batch,), K), greedy, seeds_for(batch))
    rejection_sample(p, drafts, None, torch.full((batch,), K), greedy, torch.Generator().manual_seed(0))


def test_bad_shapes_raise():
    p = torch.rand(2, K + 1, V)
    with pytest.raises(ValueError, match="draft_token_ids"):
        rejection_sample(p, torch.zeros(2, K + 1, dtype=torch.int64), None, t([1, 1]), t([False, False]), None)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(p, torch.zeros(2, K, dtype=torch.int64), torch.rand(2, K, V + 1), t([1, 1]),
                         t([False, False]), None)


# ---------------------------------------------------------------- seeds


def _row(seed: int, pos: int, gen_seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(gen_seed)
    p = torch.rand(1, K + 1, V, generator=g).softmax(-1)
    q = torch.rand(1, K, V, generator=g).softmax(-1)
    drafts = torch.randint(0, V, (1, K), generator=g)
    return p, q, drafts, t([seed]), t([pos])


@pytest.mark.parametrize("ngram", [False, True])
def test_seeded_row_is_batch_invariant(ngram: bool):
    """A seeded row gives the same output alone and at another row of a bigger batch with other rows."""
    targets = [_row(seed=1000 + i, pos=5 * i, gen_seed=i) for i in range(12)]
    alone = []
    for p, q, d, s, pos in targets:
        alone.append(rejection_sample(p, d, None if ngram else q, t([K]), t([False]), (s, pos)))
    # Each target at a different row of a 9-row batch whose other rows differ (random, greedy, fewer drafts).
    for i, (p, q, d, s, pos) in enumerate(targets):
        others = [_row(seed=77 + j, pos=j, gen_seed=500 + 9 * i + j) for j in range(8)]
        at = i % 9
        rows = [*others[:at], (p, q, d, s, pos), *others[at:]]
        cat = [torch.cat(x) for x in zip(*rows)]
        num = t([K if j == at else j % (K + 1) for j in range(9)])
        greedy = t([j % 4 == 1 and j != at for j in range(9)])
        out, n = rejection_sample(cat[0], cat[2], None if ngram else cat[1], num, greedy, (cat[3], cat[4]))
        assert torch.equal(out[at : at + 1], alone[i][0]) and n[at] == alone[i][1][0]
    # Not a constant: the targets do not all give the same thing.
    assert len({tuple(a[0][0].tolist()) for a in alone}) > 1


def test_seeded_output_depends_on_seed_and_position():
    p, q, d, _, _ = _row(seed=1, pos=0, gen_seed=0)
    batch = 512
    p, q, d = p.expand(batch, -1, -1), q.expand(batch, -1, -1), d.expand(batch, -1)
    num, greedy = torch.full((batch,), K), torch.zeros(batch, dtype=torch.bool)
    by_seed, _ = rejection_sample(p, d, q, num, greedy, (torch.arange(batch), torch.zeros(batch, dtype=torch.int64)))
    by_pos, _ = rejection_sample(p, d, q, num, greedy, (torch.zeros(batch, dtype=torch.int64), torch.arange(batch)))
    assert len({tuple(r) for r in by_seed.tolist()}) >= 8
    assert len({tuple(r) for r in by_pos.tolist()}) >= 8


def test_generator_reproducible():
    batch = 32
    p = torch.rand(batch, K + 1, V, generator=torch.Generator().manual_seed(1)).softmax(-1)
    d = torch.randint(0, V, (batch, K), generator=torch.Generator().manual_seed(2))
    args = (p, d, None, torch.full((batch,), K), torch.zeros(batch, dtype=torch.bool))
    a = rejection_sample(*args, torch.Generator().manual_seed(9))
    b = rejection_sample(*args, torch.Generator().manual_seed(9))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_accept_uniform_never_shares_a_hash_input_with_the_draw_noise():
    """Hash inputs are id * M_ID + key + salt (mod 2^64).  At the same key the accept input (id 0,
    SALT_ACCEPT) equals a draw input only at id = (SALT_ACCEPT - salt) / M_ID mod 2^64: far beyond any
    token or block id."""
    u64 = 1 << 64
    inv = pow(noise._M_ID % u64, -1, u64)
    for salt in (noise.SALT_TOKEN, noise.SALT_BLOCK):
        clash = ((SALT_ACCEPT - salt) % u64) * inv % u64
        assert clash > 1 << 40
    # Different draft-model seeds, still 63-bit.
    s = torch.arange(1000)
    d = draft_seeds(s)
    assert (d >= 0).all() and not torch.equal(d, s) and d.unique().numel() == 1000


# ---------------------------------------------------------------- helpers


def test_probs_from_logits_and_padding():
    x = torch.tensor([[0.0, float("-inf"), 0.0], [float("-inf")] * 3])
    p = probs_from_logits(x)
    assert p.dtype == torch.float32 and p.tolist() == [[0.5, 0.0, 0.5], [0.0, 0.0, 0.0]]
    num = t([2, 0, 1])
    flat = torch.arange(6 * 2).view(6, 2).float()  # rows: req0 pos0..2, req1 pos0, req2 pos0..1
    padded = pad_positions(flat, num, k=2)
    assert padded.shape == (3, 3, 2)
    assert padded[0].tolist() == flat[0:3].tolist()
    assert padded[1].tolist() == [flat[3].tolist(), [0, 0], [0, 0]]
    assert padded[2].tolist() == [flat[4].tolist(), flat[5].tolist(), [0, 0]]


def test_pack_drafts_and_accepted_lengths():
    ids, num = pack_drafts([[5, 6], [], [1, 2, 3, 4]], k=3)
    assert ids.tolist() == [[5, 6, -1], [-1, -1, -1], [1, 2, 3]] and num.tolist() == [2, 0, 3]
    assert accepted_lengths(t([3, 1, 4, 1]), t([3, 0, 3, 2])).tolist() == [2, 0, 3, 0]


def test_module_has_no_python_loop_over_rows_on_the_hot_path():
    """rejection_sample's body holds no for/while (vectorised over rows and positions)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(rs.rejection_sample))
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.For, ast.While, ast.comprehension))]
