"""Speculative decoding is exact: the emitted tokens are distributed as the target model's, draft or no draft.

The "models" are random conditional probability trees over a small vocabulary: the target gives
P_j(. | t_1..t_j) for the (j+1)-th token after any prefix, the draft Q_j(. | prefix) (n-gram mode: a
proposal R_j that picks the drafts; the sampler is told q is a point mass).  One trial = one request's
step: draft k = 3 tokens by walking Q, build target_probs from P at each drafted prefix (what the target
model computes in its verification pass: position j is conditioned on the *drafted* prefix, which equals
the emitted prefix whenever position j is reached), call rejection_sample, then finish the request to
k + 1 = 4 tokens with ordinary steps (num_draft = 0) from P given the emitted prefix, as the engine's
next steps would.  N = 50,000 trials run as one batch, one distinct seed per row (or one torch.Generator).

The exact law of the 4 tokens is the product P_0(a) P_1(b|a) P_2(c|ab) P_3(d|abc), computed in float64.
Checked by chi-square at alpha = 0.001 (cells with expected count < 5 pooled; any emitted zero-probability
token fails): the first token, the joint of the first two, the marginals of the third and fourth (the
fourth is the bonus token when all three drafts are accepted), and for V = 8 the joint of the first three.
Deliberately biased samplers (always accept; recover from p instead of the residual) fail.
Seeds are fixed, so the tests are deterministic.
"""

from __future__ import annotations

import pytest
import torch

from tests.stats.chi2 import gof
from tokenspout.sample import rejection_sampler as rs
from tokenspout.sample.ops.draw import block_mass
from tokenspout.sample.rejection_sampler import rejection_sample

N = 50_000
K = 3
ALPHA = 1e-3
BLOCK = 4  # small vocabulary blocks, so the draw's two levels (block, then token) both matter


def truncate(p: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then top-p on the last axis (test-side reference: full sort), renormalised."""
    s, order = p.sort(-1, descending=True)
    keep = torch.arange(p.shape[-1]) < top_k
    s = s * keep
    s = s / s.sum(-1, keepdim=True)
    keep = keep & ((s.cumsum(-1) - s) < top_p)
    out = torch.zeros_like(p).scatter_(-1, order, s * keep)
    return out / out.sum(-1, keepdim=True)


def tree(vocab: int, gen: torch.Generator, scale: float, top_k: int = 0, top_p: float = 1.0) -> list[torch.Tensor]:
    """Conditionals T[j] of shape [V]*j + [V]: the distribution of token j+1 given tokens 1..j."""
    out = []
    for j in range(K + 1):
        p = (torch.randn(*([vocab] * (j + 1)), generator=gen, dtype=torch.float64) * scale).softmax(-1)
        if top_k or top_p < 1.0:
            p = truncate(p, top_k or vocab, top_p)
        out.append(p)
    return out


def at(t: list[torch.Tensor], prefix: torch.Tensor) -> torch.Tensor:
    """Rows of T_j at the given prefixes [B, j] -> [B, V]."""
    j = prefix.shape[1]
    return t[j][tuple(prefix.t())] if j else t[0].expand(prefix.shape[0], -1)


def walk(t: list[torch.Tensor], batch: int, gen: torch.Generator) -> torch.Tensor:
    """k tokens per row sampled from tree t (drafting), [B, K]."""
    toks = torch.zeros(batch, 0, dtype=torch.int64)
    for _ in range(K):
        w = at(t, toks)
        nxt = (w / torch.empty_like(w).exponential_(generator=gen)).argmax(-1)
        toks = torch.cat([toks, nxt.unsqueeze(1)], 1)
    return toks


def run(p_tree: list[torch.Tensor], q_tree: list[torch.Tensor], mode: str, noise: str, seed: int,
        tell_q: list[torch.Tensor] | None = None) -> torch.Tensor:
    """N trials; returns the first K + 1 tokens of each [N, K+1].  mode 'draft' passes q, 'ngram' passes
    None.  tell_q (biased variant): the q the sampler is told, in place of the one the drafts came from."""
    gen = torch.Generator().manual_seed(seed)
    drafts = walk(q_tree, N, gen)
    target = torch.stack([at(p_tree, drafts[:, :j]) for j in range(K + 1)], 1).float()
    q = None
    if mode == "draft":
        q = torch.stack([at(tell_q or q_tree, drafts[:, :j]) for j in range(K)], 1).float()
    seeds = torch.arange(N, dtype=torch.int64) * 7919 + seed
    pos0 = torch.zeros(N, dtype=torch.int64)

    def noise_for(pos: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | torch.Generator:
        return (seeds[rows], pos[rows]) if noise == "seeds" else gen

    all_rows = torch.arange(N)
    out, n = rejection_sample(target, drafts, q, torch.full((N,), K), torch.zeros(N, dtype=torch.bool),
                              noise_for(pos0, all_rows), block_size=BLOCK)
    # Finish every row to K + 1 tokens with ordinary steps, as the engine's next steps would.
    toks = out.clone()
    while bool((n < K + 1).any()):
        rows = torch.nonzero(n < K + 1).squeeze(1)
        m = n[rows]
        prefix_len = int(m.min())  # rows with the shortest prefix first: prefixes of one length per step
        rows = rows[m == prefix_len]
        p = at(p_tree, toks[rows, :prefix_len]).float().unsqueeze(1)
        o, _ = rejection_sample(p, torch.zeros(rows.numel(), 0, dtype=torch.int64), None,
                                torch.zeros(rows.numel(), dtype=torch.int64),
                                torch.zeros(rows.numel(), dtype=torch.bool), noise_for(n, rows), block_size=BLOCK)
        toks[rows, prefix_len] = o[:, 0]
        n[rows] += 1
    return toks


def exact_joint(p_tree: list[torch.Tensor]) -> torch.Tensor:
    """P(t1..t4) as a [V]*4 float64 tensor."""
    joint = p_tree[0]
    for j in range(1, K + 1):
        joint = joint.unsqueeze(-1) * p_tree[j]
    return joint


def checks(toks: torch.Tensor, p_tree: list[torch.Tensor]) -> dict[str, float]:
    vocab = p_tree[0].shape[0]
    joint = exact_joint(p_tree)
    out = {
        "first": gof(toks[:, 0], joint.sum((1, 2, 3)).numpy()),
        "first two": gof(toks[:, 0] * vocab + toks[:, 1], joint.sum((2, 3)).flatten().numpy()),
        "third": gof(toks[:, 2], joint.sum((0, 1, 3)).numpy()),
        "fourth": gof(toks[:, 3], joint.sum((0, 1, 2)).numpy()),
    }
    if vocab <= 8:
        cells = (toks[:, 0] * vocab + toks[:, 1]) * vocab + toks[:, 2]
        out["first three"] = gof(cells, joint.sum(3).flatten().numpy())
    return out


CASES = {
    # name: (mode, noise, V, target tree kwargs, draft / proposal tree kwargs)
    "draft dense seeds": ("draft", "seeds", 12, {"scale": 1.5}, {"scale": 1.5}),
    "draft dense generator": ("draft", "generator", 16, {"scale": 1.0}, {"scale": 2.0}),
    "draft dense V8": ("draft", "seeds", 8, {"scale": 1.2}, {"scale": 1.2}),
    "draft top-k/top-p target": ("draft", "seeds", 10, {"scale": 1.5, "top_k": 6, "top_p": 0.9}, {"scale": 1.0}),
    "draft both truncated": ("draft", "seeds", 12, {"scale": 1.5, "top_k": 7}, {"scale": 1.5, "top_p": 0.8}),
    "ngram dense seeds": ("ngram", "seeds", 12, {"scale": 1.5}, {"scale": 3.0}),
    "ngram dense generator V8": ("ngram", "generator", 8, {"scale": 2.0}, {"scale": 2.0}),
    "ngram top-k/top-p target": ("ngram", "seeds", 16, {"scale": 1.5, "top_k": 5, "top_p": 0.95}, {"scale": 2.0}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_speculative_output_is_distributed_as_the_target(name: str):
    mode, noise, vocab, p_kw, q_kw = CASES[name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    p_tree, q_tree = tree(vocab, gen, **p_kw), tree(vocab, gen, **q_kw)
    toks = run(p_tree, q_tree, mode, noise, seed=sum(map(ord, name)))
    pvalues = checks(toks, p_tree)
    assert min(pvalues.values()) > ALPHA, pvalues


def _biased_setup(vocab: int = 12) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(99)
    return tree(vocab, gen, scale=1.5), tree(vocab, gen, scale=1.5)


def test_always_accept_is_caught():
    """Telling the sampler q = p makes every ratio 1: the drafts pass through unchecked."""
    p_tree, q_tree = _biased_setup()
    toks = run(p_tree, q_tree, "draft", "seeds", seed=5, tell_q=p_tree)
    assert checks(toks, p_tree)["first"] < ALPHA


@pytest.mark.parametrize("mode", ["draft", "ngram"])
def test_recovering_from_p_instead_of_the_residual_is_caught(monkeypatch, mode: str):
    p_tree, q_tree = _biased_setup()

    def from_p(p, q, x, rejected, block_size):
        return p, block_mass(p, block_size), torch.zeros(p.shape[0], 1, dtype=torch.bool)

    monkeypatch.setattr(rs, "recovery_weights", from_p)
    toks = run(p_tree, q_tree, mode, "seeds", seed=6)
    assert checks(toks, p_tree)["first"] < ALPHA
