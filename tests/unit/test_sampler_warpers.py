"""The further warpers (sample/ops/warpers.py) against outside oracles, one row at a time.

typical_p, epsilon_cutoff and eta_cutoff: transformers' TypicalLogitsWarper / EpsilonLogitsWarper / EtaLogitsWarper,
chained after its Temperature / MinP / TopK / TopP warpers in our order (test_sampler_hf.py explains the min_p
place).  top_n_sigma, XTC and dynatemp: plain per-token loops written from llama.cpp's published algorithms
(llama_sampler_top_n_sigma_apply, llama_sampler_xtc_apply, llama_sampler_temp_ext_apply), in float64.
The kept set must match exactly and the probabilities to float32 rounding.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from tokenspout.sample.ops.topk_topp import TierConfig
from tokenspout.sample.ops.warpers import xtc_coin
from tokenspout.sample.sampler import Sampler, compute_processed_logits
from tokenspout.sampling_params import SamplingParams
from tokenspout.worker.sampling_state import build_metadata

SMALL_TIERS = TierConfig(first_k=4, first_cap=8, later_k=(16,), block_size=8)
V = 64


def hf_scores(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """HF's processors in our order: temperature, min_p, top-k, top-p, typical, epsilon, eta (float64)."""
    scores = logits.double().unsqueeze(0)
    ids = torch.zeros(1, 1, dtype=torch.long)
    procs: list = [TemperatureLogitsWarper(float(p.temperature))]
    if p.min_p > 0:
        procs.append(MinPLogitsWarper(p.min_p))
    if p.top_k > 0:
        procs.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1:
        procs.append(TopPLogitsWarper(p.top_p))
    if p.typical_p < 1:
        procs.append(TypicalLogitsWarper(p.typical_p))
    if p.epsilon_cutoff > 0:
        procs.append(EpsilonLogitsWarper(p.epsilon_cutoff))
    if p.eta_cutoff > 0:
        procs.append(EtaLogitsWarper(p.eta_cutoff, device="cpu"))
    for proc in procs:
        scores = proc(ids, scores)
    return scores[0]


def ours(logits: torch.Tensor, params: list[SamplingParams], tiers: TierConfig = SMALL_TIERS,
         positions: list[int] | None = None) -> torch.Tensor:
    md = build_metadata(params, logits.shape[1], outputs=[[1] * k for k in positions] if positions else None)
    return compute_processed_logits(logits, md, tiers)


def assert_same_distribution(got: torch.Tensor, want: torch.Tensor) -> None:
    kept_got, kept_want = torch.isfinite(got), torch.isfinite(want)
    assert torch.equal(kept_got, kept_want), (kept_got.nonzero().flatten(), kept_want.nonzero().flatten())
    torch.testing.assert_close(got.double().softmax(-1), want.softmax(-1), atol=2e-6, rtol=1e-4)


def random_logits(rng: random.Random, vocab: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    # Zipf-like rows (as a model's) rather than flat Gaussians, so the cut-offs bind at varied places.
    s = 1.0 + 2.0 * torch.rand(1, generator=g)
    return (-s * torch.log(torch.rand(vocab, generator=g) * vocab + 1)).float()


HF_KNOBS = [
    dict(typical_p=0.5), dict(typical_p=0.9), dict(typical_p=0.2, temperature=1.4),
    dict(epsilon_cutoff=0.02), dict(epsilon_cutoff=3e-4, temperature=0.7), dict(eta_cutoff=0.01),
    dict(eta_cutoff=5e-4, temperature=1.3),
    dict(typical_p=0.8, epsilon_cutoff=0.01, eta_cutoff=0.003),
    dict(typical_p=0.7, top_k=10), dict(typical_p=0.6, top_p=0.9, temperature=0.9),
    dict(epsilon_cutoff=0.01, min_p=0.02, top_k=20, top_p=0.95), dict(eta_cutoff=0.02, top_p=0.8),
]


@pytest.mark.parametrize("knobs", HF_KNOBS, ids=[",".join(f"{k}={v}" for k, v in d.items()) for d in HF_KNOBS])
def test_hf_warpers(knobs: dict) -> None:
    rng = random.Random(str(knobs))
    p = SamplingParams(**knobs)
    for _ in range(6):
        x = random_logits(rng)
        assert_same_distribution(ours(x.unsqueeze(0), [p])[0], hf_scores(x, p))


def test_hf_warpers_batched_rows_independent() -> None:
    """A batch of rows with different knobs (and plain / greedy rows between them): each row as alone."""
    rng = random.Random(7)
    params = [SamplingParams(**k) for k in HF_KNOBS] + [SamplingParams(top_p=0.9), SamplingParams(temperature=0.0)]
    rng.shuffle(params)
    x = torch.stack([random_logits(rng) for _ in params])
    got = ours(x, params)
    for i, p in enumerate(params):
        if p.is_greedy:
            torch.testing.assert_close(got[i], x[i])
        else:
            assert_same_distribution(got[i], hf_scores(x[i], p))


# --- llama.cpp references, per token, float64 ---------------------------------------------------------------------

def ref_top_n_sigma(logits: list[float], n: float) -> list[float]:
    finite = [v for v in logits if v != -math.inf]
    mx = max(finite)
    mean = sum(finite) / len(finite)
    std = math.sqrt(sum((v - mean) ** 2 for v in finite) / len(finite))
    return [v if v >= mx - n * std else -math.inf for v in logits]


def softmax(logits: list[float]) -> list[float]:
    mx = max(logits)
    e = [math.exp(v - mx) if v != -math.inf else 0.0 for v in logits]
    z = sum(e)
    return [v / z for v in e]


def ref_xtc(logits: list[float], threshold: float) -> list[float]:
    """llama_sampler_xtc_apply once the coin came up: sort by p desc, pos_last = last index with p >= threshold,
    drop the tokens before it if pos_last > 0."""
    p = softmax(logits)
    order = sorted(range(len(p)), key=lambda t: -p[t])
    pos_last = 0
    for i, t in enumerate(order):
        if p[t] >= threshold:
            pos_last = i
        else:
            break
    out = list(logits)
    if pos_last > 0:
        for t in order[:pos_last]:
            out[t] = -math.inf
    return out


def ref_dynatemp(logits: list[float], temp: float, rng_: float, exponent: float) -> float:
    finite = [v for v in logits if v != -math.inf]
    p = softmax(finite)
    h = -sum(q * math.log(q) for q in p if q > 0)
    lo, hi = max(0.0, temp - rng_), temp + rng_
    return lo + (hi - lo) * (h / math.log(len(finite))) ** exponent


@pytest.mark.parametrize("n", [0.5, 1.0, 2.0, 3.5])
@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_top_n_sigma_reference(n: float, temperature: float) -> None:
    rng = random.Random(int(n * 10 + temperature * 100))
    for _ in range(5):
        x = random_logits(rng)
        x[rng.randrange(V)] = -math.inf  # a masked token must not count in the mean / std
        want = [v / temperature for v in ref_top_n_sigma(x.double().tolist(), n)]
        got = ours(x.unsqueeze(0), [SamplingParams(top_n_sigma=n, temperature=temperature)])[0]
        assert_same_distribution(got, torch.tensor(want, dtype=torch.float64))


def test_top_n_sigma_then_top_k_top_p() -> None:
    rng = random.Random(3)
    p = SamplingParams(top_n_sigma=1.5, top_k=12, top_p=0.9, temperature=0.8)
    for _ in range(5):
        x = random_logits(rng)
        masked = torch.tensor(ref_top_n_sigma(x.double().tolist(), 1.5))
        want = hf_scores(masked.float(), SamplingParams(top_k=12, top_p=0.9, temperature=0.8))
        assert_same_distribution(ours(x.unsqueeze(0), [p])[0], want)


@pytest.mark.parametrize("threshold", [0.05, 0.1, 0.2, 0.4])
@pytest.mark.parametrize("extra", [{}, {"top_k": 20}, {"top_p": 0.95, "temperature": 1.3}], ids=["plain", "k", "p"])
def test_xtc_reference(threshold: float, extra: dict) -> None:
    """xtc_probability 1: the coin always comes up; tokens dropped exactly as llama.cpp's loop drops them."""
    rng = random.Random(int(threshold * 1000))
    p = SamplingParams(xtc_probability=1.0, xtc_threshold=threshold, **extra)
    before = SamplingParams(**extra)
    hits = 0
    for _ in range(8):
        x = random_logits(rng) * rng.uniform(0.3, 3.0)  # flat to sharp rows
        top = int(x.argmax())
        rivals = rng.sample(range(V), rng.randrange(0, 3))
        if rivals:  # a sharp row with a few near-top rivals, so that high thresholds bind too
            x -= 6.0
            x[top] += 6.0
        for j in rivals:
            x[j] = x[top] - rng.uniform(0.0, 0.5)
        prior = hf_scores(x, before)
        want = torch.tensor(ref_xtc(prior.tolist(), threshold), dtype=torch.float64)
        got = ours(x.unsqueeze(0), [p])[0]
        assert_same_distribution(got, want)
        hits += int(torch.isfinite(want).sum() < torch.isfinite(prior).sum())
    assert hits, "no row had two tokens above the threshold: the test would not see XTC act"


def test_xtc_threshold_above_half_is_off() -> None:
    md = build_metadata([SamplingParams(xtc_probability=1.0, xtc_threshold=0.6)], V)
    assert md.warp is None


@pytest.mark.parametrize("rng_,exponent", [(0.5, 1.0), (0.9, 0.5), (1.5, 2.0)])
@pytest.mark.parametrize("temperature", [0.7, 1.2])
def test_dynatemp_reference(rng_: float, exponent: float, temperature: float) -> None:
    rng = random.Random(int(rng_ * 10 + exponent * 100 + temperature))
    for _ in range(5):
        x = random_logits(rng) * rng.uniform(0.2, 1.5)
        t = ref_dynatemp(x.double().tolist(), temperature, rng_, exponent)
        p = SamplingParams(temperature=temperature, dynatemp_range=rng_, dynatemp_exponent=exponent, top_p=0.9)
        want = hf_scores(x, SamplingParams(temperature=t, top_p=0.9))
        assert_same_distribution(ours(x.unsqueeze(0), [p])[0], want)


@pytest.mark.parametrize("top_k", [1, 7, 40])
def test_dynatemp_entropy_over_the_top_k_candidates(top_k: int) -> None:
    """With top-k, the entropy is that of the row's top-k candidates (llama.cpp takes it over what its truncation
    left): the temperature from the reference on the top-k logits, then top-k and top-p at that temperature."""
    rng = random.Random(top_k)
    apart = 0.0
    for _ in range(5):
        x = random_logits(rng) * rng.uniform(0.3, 1.5)
        kth = sorted(x.double().tolist(), reverse=True)[top_k - 1]
        cands = [v if v >= kth else -math.inf for v in x.double().tolist()]
        t = 0.9 if top_k == 1 else ref_dynatemp(cands, 0.9, 0.6, 1.3)  # one candidate: the row's own temperature
        p = SamplingParams(temperature=0.9, dynatemp_range=0.6, dynatemp_exponent=1.3, top_k=top_k, top_p=0.95)
        want = hf_scores(x, SamplingParams(temperature=t, top_k=top_k, top_p=0.95))
        assert_same_distribution(ours(x.unsqueeze(0), [p])[0], want)
        apart = max(apart, abs(ref_dynatemp(x.double().tolist(), 0.9, 0.6, 1.3) - t))
    assert top_k == 1 or apart > 0.01  # (the whole row's entropy would give other temperatures)


# --- gating, routing, invariance ------------------------------------------------------------------------------------

def test_no_warper_rows_no_warp_batch() -> None:
    md = build_metadata([SamplingParams(top_p=0.9), SamplingParams(temperature=0.0),
                         SamplingParams(temperature=0.0, typical_p=0.5, xtc_probability=1.0)], V)
    assert md.warp is None  # greedy rows ignore the warpers: an all-greedy / plain batch pays nothing


def test_warped_rows_leave_the_kernel() -> None:
    md = build_metadata([SamplingParams(top_p=0.9), SamplingParams(typical_p=0.5), SamplingParams(top_k=5)], V)
    assert md.warp is not None and md.warp.rows == [1]
    assert md.kernel_rows == [0, 2]


def test_xtc_coin_is_the_rows_own() -> None:
    """The coin is a function of (seed, position) only: the same in any batch, at any row; P(act) = probability."""
    keys = build_metadata([SamplingParams(xtc_probability=0.3)] * 4000, V, seeds=list(range(4000))).seed_keys
    coin = xtc_coin(keys, torch.zeros(4000, dtype=torch.int64), torch.full((4000,), 0.3))
    assert abs(coin.double().mean().item() - 0.3) < 0.03
    alone = xtc_coin(keys[17:18], torch.zeros(1, dtype=torch.int64), torch.full((1,), 0.3))
    assert bool(alone[0] == coin[17])


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "cpu-kernel"])
def test_seeded_row_batch_invariant(kernel: bool) -> None:
    """A seeded warped row draws the same tokens alone and at another row among other kinds of rows."""
    rng = random.Random(11)
    x = torch.stack([random_logits(rng, 512) for _ in range(6)])
    target = SamplingParams(xtc_probability=0.5, xtc_threshold=0.05, typical_p=0.9, top_n_sigma=2.0,
                            dynatemp_range=0.5, seed=99)
    others = [SamplingParams(top_p=0.9), SamplingParams(temperature=0.0), SamplingParams(epsilon_cutoff=0.01),
              SamplingParams(top_k=3), SamplingParams(eta_cutoff=0.02, top_k=40)]
    sampler = Sampler(SMALL_TIERS, cpu_kernel=kernel)
    for step in range(20):
        alone = sampler(x[3:4].clone(), build_metadata([target], 512, outputs=[[0] * step])).sampled_token_ids
        batch = [*others[:3], target, *others[3:]]
        md = build_metadata(batch, 512, outputs=[[0] * step] * 6, seeds=[1, 2, 3, 99, 5, 6])
        mixed = sampler(x.clone(), md).sampled_token_ids
        assert int(mixed[3]) == int(alone[0])


def test_warpers_on_dense_and_sparse_paths_agree() -> None:
    """The same row through a candidate set (top_k = V) and densely (no top-k): the same kept distribution."""
    rng = random.Random(5)
    for knobs in HF_KNOBS[:8]:
        x = random_logits(rng).unsqueeze(0)
        dense = ours(x, [SamplingParams(**knobs)])
        sparse = ours(x, [SamplingParams(**knobs, top_k=V - 1)], TierConfig(first_k=V, first_cap=V, block_size=8))
        want = hf_scores(x[0], SamplingParams(**knobs, top_k=V - 1))
        assert_same_distribution(sparse[0], want)
        if torch.equal(torch.isfinite(want), torch.isfinite(hf_scores(x[0], SamplingParams(**knobs)))):
            assert_same_distribution(dense[0], want)


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.9, 0.99])
def test_typical_buckets_equal_the_sort(mass: float) -> None:
    """Whole rows take typical's bucketed cut (no vocabulary sort): the same kept set as sorting, on 128k-token
    rows with ties (bf16 logits) and masked tokens, and on small rows against transformers."""
    from tokenspout.sample.ops.warpers import typical

    g = torch.Generator().manual_seed(int(mass * 100))
    s = 1.0 + 2.0 * torch.rand(8, 1, generator=g)
    y = (-s * torch.log(torch.rand(8, 128_256, generator=g) * 128_256 + 1)).bfloat16().float()
    y[:, ::7] = float("-inf")
    m = torch.full((8,), mass)
    assert torch.equal(typical(y, m, buckets=True), typical(y, m, buckets=False))
    rng = random.Random(int(mass * 1000))
    for _ in range(6):
        x = random_logits(rng)
        hf = torch.isfinite(TypicalLogitsWarper(mass)(torch.zeros(1, 1, dtype=torch.long), x.double().unsqueeze(0))[0])
        assert torch.equal(typical(x.unsqueeze(0), m[:1], buckets=True)[0], hf)
