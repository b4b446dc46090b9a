"""The one-call CPU kernel for random rows (ops/rows_cpu.py) against the torch path it replaces.

Both compute the same kept distribution and hash the same noise, so they must draw the same token row for
row.  Float32 sums and exp may round differently in the two (the kernel sums in candidate order, torch in
its own), which can flip a decision only when it sits within an ulp of a boundary: a few in a million rows.
The distribution itself is checked by tests/stats/test_sampler_stats.py (path "cpu-kernel").
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenspout.platform import cpu_flags
from tokenspout.sample.ops.topk_topp import TierConfig
from tokenspout.sample.sampler import Sampler
from tokenspout.sampling_params import SamplingParams
from tokenspout.worker.sampling_state import build_metadata

NEG_INF = float("-inf")
V = 49152  # the default model's vocabulary: many blocks of 256, and a pooled candidate pass in torch

pytestmark = pytest.mark.skipif(Sampler()._lib is None, reason="the kernel library does not build here")


def both(x: torch.Tensor, params: list[SamplingParams], **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
    kernel = Sampler()(x.clone(), build_metadata(params, x.shape[1], **kw)).sampled_token_ids  # type: ignore[arg-type]
    torch_path = Sampler(cpu_kernel=False)(x.clone(), build_metadata(params, x.shape[1], **kw)).sampled_token_ids  # type: ignore[arg-type]
    return kernel, torch_path


def random_params(g: torch.Generator, n: int, trial: int) -> list[SamplingParams]:
    """Every kind of row the kernel takes: top-k (1..1024) or not, with or without top-p and min_p."""
    def u() -> float:
        return float(torch.rand(1, generator=g))

    return [SamplingParams(temperature=0.05 + 1.6 * u(),
                           top_k=int(torch.randint(1, 1025, (1,), generator=g)) if i % 2 else 0,
                           top_p=0.05 + 0.95 * u() if (trial + i // 2) % 2 else 1.0,
                           min_p=0.3 * u() if (trial + i // 4) % 3 == 0 else 0.0,
                           seed=1000 * trial + i) for i in range(n)]


def test_the_kernel_builds_on_an_avx2_machine() -> None:
    # Not skipped silently where it should run: this machine and CI have AVX2 and gcc.
    assert {"avx2", "fma", "f16c"} <= cpu_flags()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16-ties"])
def test_kernel_draws_what_the_torch_path_draws(dtype: str) -> None:
    g = torch.Generator().manual_seed(7)
    mismatches = total = 0
    for trial in range(24):
        rows = 16
        x = torch.randn(rows, V, generator=g) * (0.5 + trial % 6)
        if dtype != "float32":
            x = x.bfloat16().float()  # many exact ties, also at the k-th value and the top-p boundary
        if trial % 5 == 0:  # a grammar-like mask: most of the vocabulary at -inf, fewer survivors than top_k
            x[:, 300:] = NEG_INF
        kernel, ref = both(x, random_params(g, rows, trial))
        mismatches += int((kernel != ref).sum())
        total += rows
    assert total == 384
    assert mismatches == 0


def test_wide_nucleus_and_flat_rows() -> None:
    """Top-p rows whose nucleus holds thousands of tokens (flat logits at a high temperature): the torch path
    needs its bucketed nucleus there; the kernel walks its thresholds down to them."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(12, V, generator=g) * 0.3
    params = [SamplingParams(temperature=1.5, top_p=tp, seed=i) for i, tp in enumerate([0.5, 0.9, 0.99] * 4)]
    kernel, ref = both(x, params)
    assert torch.equal(kernel, ref)


def test_positions_change_the_draw_like_the_torch_path() -> None:
    x = torch.randn(1, V, generator=torch.Generator().manual_seed(3)).expand(64, V).contiguous()
    p = SamplingParams(temperature=1.0, top_k=200, top_p=0.9, seed=5)
    params = [p] * 64
    outputs = [[1] * i for i in range(64)]  # one request at 64 output positions
    kernel, ref = both(x, params, outputs=outputs, seeds=[5] * 64)
    assert torch.equal(kernel, ref)
    assert kernel.unique().numel() > 10  # the position really moves the noise


def test_ties_wider_than_the_stack_buffer() -> None:
    """Uniform logits: every token ties with the k-th, so all stay (as HF's top-k); the kernel takes its
    heap-allocated path.  Draws must be spread over the whole vocabulary, and agree with torch."""
    x = torch.zeros(8, V)
    kernel, ref = both(x, [SamplingParams(top_k=5, seed=i) for i in range(8)])
    assert torch.equal(kernel, ref)
    assert kernel.max() > 1000


def test_fewer_finite_logits_than_top_k() -> None:
    x = torch.full((4, V), NEG_INF)
    x[:, [7, 70, 700]] = torch.tensor([1.0, 0.5, 0.25])
    kernel, ref = both(x, [SamplingParams(top_k=50, seed=i) for i in range(4)])
    assert torch.equal(kernel, ref)
    assert set(kernel.tolist()) <= {7, 70, 700}


def test_top_k_one_is_the_argmax() -> None:
    x = torch.randn(8, V, generator=torch.Generator().manual_seed(11))
    kernel, _ = both(x, [SamplingParams(top_k=1, temperature=1.3, seed=i) for i in range(8)])
    assert torch.equal(kernel, x.argmax(-1))


def test_mixed_batch_routes_each_row() -> None:
    """Kernel rows (top-k, top-p only, temperature only), torch rows (processed logprobs, top_k above the cap) and
    greedy rows in one batch: each row draws what it draws alone, whatever its neighbours."""
    g = torch.Generator().manual_seed(5)
    params = [
        SamplingParams(top_k=40, top_p=0.9, seed=1),
        SamplingParams(top_p=0.9, seed=2),
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=40, seed=3, logprobs=2, logprobs_mode="processed_logprobs"),
        SamplingParams(top_k=2000, seed=4),
        SamplingParams(top_k=7, temperature=0.6, seed=5),
        SamplingParams(temperature=0.9, seed=6),
        SamplingParams(temperature=0.9, seed=7, logprobs=1, logprobs_mode="processed_logprobs"),
    ]
    x = torch.randn(len(params), V, generator=g) * 2
    meta = build_metadata(params, V)
    assert meta.kernel_rows == [0, 1, 5, 6]
    kernel, ref = both(x, params)
    assert torch.equal(kernel, ref)
    alone = [int(Sampler()(x[i : i + 1].clone(), build_metadata([p], V)).sampled_token_ids[0])
             for i, p in enumerate(params)]
    assert kernel.tolist() == alone


def warped_params(g: torch.Generator, n: int, trial: int) -> list[SamplingParams]:
    """Rows the warped kernel takes: top-k with every warper (ops/warpers.py), alone and together, and top-p / min_p."""
    def u() -> float:
        return float(torch.rand(1, generator=g))

    knobs = [{"typical_p": 0.2 + 0.79 * u()}, {"epsilon_cutoff": 0.05 * u()}, {"eta_cutoff": 0.05 * u()},
             {"top_n_sigma": 0.3 + 3 * u()}, {"xtc_probability": u(), "xtc_threshold": 0.02 + 0.3 * u()},
             {"dynatemp_range": 1.5 * u(), "dynatemp_exponent": 0.3 + 2 * u()}]
    out = []
    for i in range(n):
        kw = dict(knobs[i % len(knobs)])
        if (trial + i) % 3 == 0:
            for extra in knobs[(i + 1) % len(knobs)], knobs[(i + 3) % len(knobs)]:
                kw.update(extra)
        out.append(SamplingParams(temperature=0.3 + 1.2 * u(), top_k=int(torch.randint(1, 400, (1,), generator=g)),
                                  top_p=0.5 + 0.5 * u() if i % 2 else 1.0, min_p=0.05 * u() if i % 4 == 1 else 0.0,
                                  seed=1000 * trial + i, **kw))
    return out


def test_warped_kernel_draws_what_the_torch_path_draws() -> None:
    """Rows with top-k and warpers take the warped kernel (ts_sample_rows_warped): token for token the torch path's
    draw, the XTC coin included (positions vary it)."""
    g = torch.Generator().manual_seed(17)
    mismatches = total = 0
    for trial in range(12):
        rows = 16
        x = torch.randn(rows, V, generator=g) * (0.5 + trial % 4)
        if trial % 4 == 0:
            x[:, 500:] = NEG_INF  # a masked vocabulary: fewer finite logits than some top_k
        params = warped_params(g, rows, trial)
        outputs = [[1] * (trial + i) for i in range(rows)]
        assert build_metadata(params, V).warp_kernel_rows == list(range(rows))
        kernel, ref = both(x, params, outputs=outputs)
        mismatches += int((kernel != ref).sum())
        total += rows
    assert total == 192
    assert mismatches <= 1  # a decision within an ulp of a boundary (double sums here, float32 in torch)


def test_warped_and_plain_kernel_rows_in_one_batch() -> None:
    params = [SamplingParams(top_k=40, typical_p=0.8, seed=1), SamplingParams(top_p=0.9, seed=2),
              SamplingParams(typical_p=0.8, seed=3), SamplingParams(temperature=0.0),
              SamplingParams(top_k=30, xtc_probability=1.0, xtc_threshold=0.05, seed=4)]
    meta = build_metadata(params, V)
    assert (meta.kernel_rows, meta.warp_kernel_rows, meta.warp.rows) == ([1], [0, 4], [0, 2, 4])
    x = torch.randn(len(params), V, generator=torch.Generator().manual_seed(2)) * 3
    kernel, ref = both(x, params)
    assert torch.equal(kernel, ref)
    alone = [int(Sampler()(x[i : i + 1].clone(), build_metadata([p], V)).sampled_token_ids[0])
             for i, p in enumerate(params)]
    assert kernel.tolist() == alone


def test_warped_kernel_whole_rows() -> None:
    """Warped rows without top-k (no typical_p) take the kernel's whole-row path: top_n_sigma, dynatemp, min_p,
    top-p (bucketed), epsilon, eta, XTC; token for token the torch path's draw.  typical_p rows without top-k stay
    on the torch path."""
    g = torch.Generator().manual_seed(23)
    mismatches = total = 0
    for trial in range(8):
        rows = 16
        x = torch.randn(rows, V, generator=g) * (1.0 + trial % 4)
        params = [dataclasses.replace(p, top_k=0, typical_p=1.0) for p in warped_params(g, rows, trial)]
        meta = build_metadata(params, V)
        warped = [i for i, p in enumerate(params) if p.uses_warpers]  # (rows whose one knob was typical_p: plain)
        assert meta.warp_kernel_rows == warped and len(warped) >= rows // 2
        kernel, ref = both(x, params, outputs=[[1] * (trial + i) for i in range(rows)])
        mismatches += int((kernel != ref).sum())
        total += rows
    assert total == 128 and mismatches <= 1
    assert build_metadata([SamplingParams(typical_p=0.5), SamplingParams(top_k=5, typical_p=0.5)],
                          V).warp_kernel_rows == [1]


@pytest.mark.parametrize("vocab", [37, 1003, 4133])
def test_warped_kernel_whole_rows_with_a_cut(vocab: int) -> None:
    """Whole rows (no top-k, no top-p) with top_n_sigma or min_p take the kernel's sparse path (one read, then only
    the 8-token sub-rows that hold kept tokens), with dynatemp, epsilon, eta and XTC on top; vocabularies that are
    not whole sub-rows (the dense path's scalar tail), masked tokens, flat and peaked rows: token for token the
    torch path's draw."""
    g = torch.Generator().manual_seed(vocab)
    rows = 24
    u = torch.rand(rows, vocab, generator=g)
    x = -(0.5 + 2.0 * torch.rand(rows, 1, generator=g)) * torch.log(u * vocab + 1)
    x[::3] = torch.randn(rows // 3, vocab, generator=g)  # flat rows: min_p keeps many
    x[1::4, : vocab // 2] = NEG_INF
    params = []
    for i in range(rows):
        knobs: dict = {"min_p": 0.02 + 0.1 * (i % 5)} if i % 3 else {"top_n_sigma": 0.5 + 0.5 * (i % 4)}
        if i % 2:
            knobs |= {"xtc_probability": 0.9, "xtc_threshold": 0.05}
        if i % 4 == 2:
            knobs |= {"epsilon_cutoff": 1e-3} if i % 8 == 2 else {"eta_cutoff": 2e-3}
        if i % 5 == 3:
            knobs |= {"dynatemp_range": 0.4}
        params.append(SamplingParams(temperature=0.4 + 0.1 * (i % 9), seed=5 * i, **knobs))
    meta = build_metadata(params, vocab)
    warped = [i for i, p in enumerate(params) if p.uses_warpers]  # (min_p alone: the plain kernel's row)
    assert meta.warp_kernel_rows == warped and len(warped) >= 18
    kernel, ref = both(x.contiguous(), params, outputs=[[1] * (i + 1) for i in range(rows)])
    assert int((kernel != ref).sum()) <= 1
    assert bool(torch.isfinite(x.gather(1, kernel.unsqueeze(1))).all())


def mirostat_rows(g: torch.Generator, rows: int, trial: int) -> torch.Tensor:
    """Row shapes that steer the mirostat kernel down each of its paths: LLM-like (Zipf over a random order: a few
    sub-rows read again), a rising ramp (the running max grows block after block: z rescaled), nearly flat (the kept
    set spans most sub-rows, or for v1 every token), a masked vocabulary, a single finite logit."""
    u = torch.rand(rows, V, generator=g)
    s = 1.2 + torch.rand(rows, 1, generator=g)
    x = -s * torch.log(u * V + 1)
    kind = trial % 5
    if kind == 1:
        x = torch.linspace(-25.0, 0.0, V).expand(rows, V) + 0.5 * torch.rand(rows, V, generator=g)
    elif kind == 2:
        x = 0.05 * torch.randn(rows, V, generator=g)
    elif kind == 3:
        x[:, 700:] = NEG_INF
    elif kind == 4:
        x[::2, 1:] = NEG_INF
    return x.contiguous()


@pytest.mark.parametrize("block_size", [256, 100])
def test_mirostat_kernel_draws_what_the_torch_path_draws(block_size: int) -> None:
    """Mirostat rows on the kernel (v2 in one pass with a running max, then the sub-rows that hold kept tokens; v1 on
    its top-100 candidates and wider) against the torch path: the same token and the same new mu, row for row.  A
    block size that is not whole 8-token sub-rows takes v2's second read of the whole row with the cut."""
    g = torch.Generator().manual_seed(29)
    tiers = dataclasses.replace(TierConfig(), block_size=block_size)
    mismatches = total = 0
    for trial in range(15):
        rows = 16
        x = mirostat_rows(g, rows, trial)
        params = [SamplingParams(mirostat=1 + (i + trial) % 2, mirostat_tau=0.5 + 9.5 * float(torch.rand(1, generator=g)),
                                 mirostat_eta=0.1, temperature=0.3 + 1.2 * float(torch.rand(1, generator=g)),
                                 seed=100 * trial + i) for i in range(rows)]
        metas = [build_metadata(params, V), build_metadata(params, V)]
        assert metas[0].mirostat is not None and metas[0].mirostat.kernel_rows == list(range(rows))
        kernel = Sampler(tiers)(x.clone(), metas[0]).sampled_token_ids
        ref = Sampler(tiers, cpu_kernel=False)(x.clone(), metas[1]).sampled_token_ids
        mismatches += int((kernel != ref).sum())
        total += rows
        mu_kernel = [st.mu for st in metas[0].mirostat.states]
        mu_ref = [st.mu for st in metas[1].mirostat.states]
        same = (kernel == ref).tolist()
        assert [a for a, ok in zip(mu_kernel, same) if ok] == pytest.approx([b for b, ok in zip(mu_ref, same) if ok],
                                                                           abs=1e-3)
    assert total == 240 and mismatches <= 1


def mirostat1_k(x: torch.Tensor, temperature: float, mu: float) -> torch.Tensor:
    """Mirostat 1's k per row (ops/mirostat.py's formula, float64): which path of the kernel each row takes."""
    top = (x.double() / temperature).topk(100, dim=-1).values
    ti = torch.log(torch.arange(2, 101, dtype=torch.float64) / torch.arange(1, 100, dtype=torch.float64))
    s = ((top[:, :-1] - top[:, 1:]) * ti).sum(-1) / (ti * ti).sum()
    n = x.shape[1]
    k = (((s - 1) * 2.0 ** mu / (1 - n ** (1 - s))) ** (1 / s)).nan_to_num(1.0)
    return k.clamp(1, n).floor().long()


@pytest.mark.parametrize("block_size", [256, 100])
def test_mirostat_1_every_width_of_k(block_size: int) -> None:
    """Mirostat 1 on LLM-like rows with mu from 4 to 60, so that k runs from a few tokens (among the top-100
    candidates) through hundreds and thousands (the threshold from the 32-token groups' maxes, then from the 8-token
    sub-rows' for a k past the groups' count) and tens of thousands (the sampled bracket: a second read) to the whole
    vocabulary; a block size that is not a whole number of the kernel's 32-token groups takes its last resort.  The
    kernel draws what the torch path draws and moves mu the same way, row for row."""
    g = torch.Generator().manual_seed(31)
    rows, n = 24, 128_256  # a Llama-3 vocabulary: enough sampled groups for the sparse second read
    u = torch.rand(rows, n, generator=g)
    x = (-(1.0 + 1.5 * torch.rand(rows, 1, generator=g)) * torch.log(u * n + 1)).contiguous()
    taus = [2.0 + 0.5 * i for i in range(rows - 3)] + [20.0, 25.0, 30.0]  # mu starts at 2 tau
    k = torch.stack([mirostat1_k(x[i:i + 1], 0.8, 2 * taus[i])[0] for i in range(rows)])
    assert int((k <= 100).sum()) >= 3 and int(((k > 100) & (k < 450)).sum()) >= 2
    assert int(((k >= 2000) & (k < n)).sum()) >= 3 and int((k == n).sum()) >= 3
    groups, subrows = -(-n // 32), -(-n // 8)
    assert int(((k > groups) & (k <= subrows)).sum()) >= 1 and int(((k > subrows) & (k < n)).sum()) >= 1
    params = [SamplingParams(mirostat=1, mirostat_tau=taus[i], temperature=0.8, seed=7 * i) for i in range(rows)]
    tiers = dataclasses.replace(TierConfig(), block_size=block_size)
    for step in range(3):  # mu moves between steps: each row's k with it
        metas = [build_metadata(params, n), build_metadata(params, n)]
        for m in metas:
            for st, tau in zip(m.mirostat.states, taus):
                st.mu = 2 * tau - step
            m.mirostat.mu.copy_(torch.tensor([st.mu for st in m.mirostat.states]))
        kernel = Sampler(tiers)(x.clone(), metas[0]).sampled_token_ids
        ref = Sampler(tiers, cpu_kernel=False)(x.clone(), metas[1]).sampled_token_ids
        assert int((kernel != ref).sum()) <= 1
        same = (kernel == ref).tolist()
        mu_kernel = [st.mu for st, ok in zip(metas[0].mirostat.states, same) if ok]
        assert mu_kernel == pytest.approx([st.mu for st, ok in zip(metas[1].mirostat.states, same) if ok], abs=1e-3)


@pytest.mark.parametrize("vocab", [37, 100, 1003, 4133])
def test_mirostat_1_odd_vocabularies(vocab: int) -> None:
    """Mirostat 1 where the vocabulary is not whole 8-token sub-rows or 32-token groups (the tail's maxes), or has at
    most 100 tokens (every token a candidate), with the row's max in the tail on half the rows, masked tokens on a
    quarter, and k from 1 to the whole vocabulary: the kernel draws what the torch path draws, mu moves alike."""
    g = torch.Generator().manual_seed(vocab)
    rows = 24
    u = torch.rand(rows, vocab, generator=g)
    x = (-(1.0 + 1.5 * torch.rand(rows, 1, generator=g)) * torch.log(u * vocab + 1)).contiguous()
    x[::2, -1] = x[::2].amax(-1) + 0.5
    x[1::4, : vocab // 3] = float("-inf")
    params = [SamplingParams(mirostat=1, mirostat_tau=0.5 + 0.6 * i, temperature=0.7, seed=3 * i) for i in range(rows)]
    k = torch.stack([mirostat1_k(x[i:i + 1].clamp(min=-1e4), 0.7, 2 * params[i].mirostat_tau)[0]
                     for i in range(rows)]) if vocab > 100 else None
    if k is not None:
        assert int((k <= 100).sum()) >= 2 and int(((k > 100) & (k < vocab)).sum()) >= 2
    metas = [build_metadata(params, vocab), build_metadata(params, vocab)]
    assert metas[0].mirostat is not None and metas[0].mirostat.kernel_rows == list(range(rows))
    kernel = Sampler()(x.clone(), metas[0]).sampled_token_ids
    ref = Sampler(cpu_kernel=False)(x.clone(), metas[1]).sampled_token_ids
    assert int((kernel != ref).sum()) <= 1
    assert bool(torch.isfinite(x.gather(1, kernel.unsqueeze(1))).all())
    same = (kernel == ref).tolist()
    assert [s.mu for s, ok in zip(metas[0].mirostat.states, same) if ok] == pytest.approx(
        [s.mu for s, ok in zip(metas[1].mirostat.states, same) if ok], abs=1e-3)


def test_mirostat_1_ties_wider_than_the_candidates() -> None:
    """Mirostat 1 whose k-th value (k = 110) is shared by ~6,000 tokens: the 110th largest group max is that value
    itself, so the kernel packs all ~6,000 ties and keeps every one of them, draws what the torch path draws, and the
    mu updates agree."""
    v = 20000
    x = torch.full((16, v), -30.0)
    x[:, :40] = torch.linspace(0, -4, 40)
    x[:, 40:6000] = -4.5
    params = [SamplingParams(mirostat=1, mirostat_tau=6.0, seed=i) for i in range(16)]
    metas = [build_metadata(params, v), build_metadata(params, v)]
    kernel = Sampler()(x.clone(), metas[0]).sampled_token_ids
    ref = Sampler(cpu_kernel=False)(x.clone(), metas[1]).sampled_token_ids
    assert torch.equal(kernel, ref)
    assert int((kernel >= 40).sum()) >= 8  # the draws do land among the ties
    assert [s.mu for s in metas[0].mirostat.states] == pytest.approx([s.mu for s in metas[1].mirostat.states], abs=1e-4)


@pytest.mark.parametrize("width", [V, 1, 7, 8, 13, 64])
def test_greedy_rows_take_torch_argmax(width: int) -> None:
    """The kernel's argmax (all-greedy batches and the greedy rows of mixed ones) is torch.argmax: the first of
    tied maxima (-0.0 ties 0.0), the first NaN where a row holds one, index 0 of an all -inf row; any width."""
    g = torch.Generator().manual_seed(11)
    rows = []
    for trial in range(8):
        x = torch.randn(9, width, generator=g)
        if trial % 4 == 1:
            x = torch.randint(-2, 3, (9, width), generator=g).float()  # ties at the maximum
            x[0] = torch.where(x[0] == 0, torch.tensor(-0.0), x[0])
        elif trial % 4 == 2:
            x[2, int(torch.randint(0, width, (1,), generator=g))] = float("nan")
            x[3] = float("nan")
        elif trial % 4 == 3:
            x[4] = NEG_INF
            x[5, width - 1] = 1e30
        rows.append(x)
    x = torch.cat(rows)
    greedy = [SamplingParams(temperature=0.0)] * x.shape[0]
    kernel, ref = both(x, greedy)
    assert torch.equal(kernel, x.argmax(-1)) and torch.equal(ref, x.argmax(-1))
    # greedy rows among random ones: the same argmax on the selected rows
    mixed = [SamplingParams(temperature=0.0) if i % 3 else SamplingParams(temperature=0.7, seed=i)
             for i in range(x.shape[0])]
    kernel, ref = both(x.nan_to_num(nan=0.0), mixed)
    sel = torch.tensor([i for i in range(x.shape[0]) if i % 3])
    assert torch.equal(kernel[sel], x.nan_to_num(nan=0.0)[sel].argmax(-1)) and torch.equal(kernel[sel], ref[sel])
