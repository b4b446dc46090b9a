"""Mirostat 1 / 2 against plain float64 references written from llama.cpp's llama_sampler_mirostat(_v2)_apply: the
kept set for a given mu, the running mu recurrence mu <- mu - eta * (surprise - tau) over many steps of the real
sampler, the state carried across preemption (the request's object), and chi-square of the draws."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from tests.stats.chi2 import gof
from tokenspout.sample.ops.mirostat import MirostatState
from tokenspout.sample.ops.topk_topp import TierConfig
from tokenspout.sample.sampler import Sampler
from tokenspout.sampling_params import SamplingParams
from tokenspout.worker.sampling_state import SamplingState

V = 300


def ref_keep(y: list[float], mode: int, mu: float) -> list[int]:
    """Token ids kept, as llama.cpp: softmax sorted descending; v2 stops at the first surprise > mu (keeping >= 1);
    v1 estimates s from the top 100, k = ((s-1) 2^mu / (1 - V^(1-s)))^(1/s), keeps the top max(int(k), 1)."""
    mx = max(y)
    z = sum(math.exp(v - mx) for v in y)
    p = [math.exp(v - mx) / z for v in y]
    order = sorted(range(len(y)), key=lambda t: (-p[t], t))
    if mode == 2:
        n = 0
        while n < len(order) and -math.log2(p[order[n]]) <= mu:
            n += 1
        return order[:max(n, 1)]
    num = den = 0.0
    for i in range(min(99, len(y) - 1)):
        t_i = math.log((i + 2) / (i + 1))
        b_i = math.log(p[order[i]] / p[order[i + 1]])
        num += t_i * b_i
        den += t_i * t_i
    s = num / den
    eps = s - 1
    k = ((eps * 2 ** mu) / (1 - len(y) ** (-eps))) ** (1 / s)
    k = max(int(k), 1)
    return order[:k]


def zipf_logits(rng: random.Random) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    s = 0.6 + 1.4 * torch.rand(1, generator=g)
    return (-s * torch.log(torch.rand(V, generator=g) * V + 1)).float()


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "torch"])
@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_running_mu_follows_the_recurrence(mode: int, temperature: float, kernel: bool) -> None:
    """Steps of the real sampler: the kept set each step is the reference's for the mu the state held, and the
    state's mu follows mu - eta * (-log2 p_kept(drawn) - tau), p renormalised over the kept tokens."""
    rng = random.Random(mode * 10 + int(temperature * 10))
    tau, eta = 3.0, 0.2
    p = SamplingParams(mirostat=mode, mirostat_tau=tau, mirostat_eta=eta, temperature=temperature, seed=5)
    state = SamplingState(2, V, torch.device("cpu"))
    state.add_request(0, p, [1, 2], [], 5)
    state.add_request(1, SamplingParams(top_p=0.9), [1], [], 6)  # a kernel row beside it
    ms = state._slots[0].mirostat
    assert ms is not None and ms.mu == 2 * tau
    sampler = Sampler(TierConfig(block_size=16), cpu_kernel=kernel)
    if kernel and sampler._lib is None:
        pytest.skip("the kernel does not build here")
    mu = 2 * tau
    for _ in range(40):
        logits = torch.stack([zipf_logits(rng), zipf_logits(rng)])
        y = (logits[0].double() / temperature).tolist()
        keep = ref_keep(y, mode, mu)
        tok = int(sampler(logits.clone(), state.metadata([0, 1])).sampled_token_ids[0])
        assert tok in keep
        mx = max(y[t] for t in keep)
        z = sum(math.exp(y[t] - mx) for t in keep)
        mu -= eta * (-math.log2(math.exp(y[tok] - mx) / z) - tau)
        assert ms.mu == pytest.approx(mu, abs=1e-4)
        state.append_tokens([0, 1], [[tok], [0]])
    assert abs(mu - 2 * tau) > 1e-3  # it moved


def test_state_survives_preemption() -> None:
    """The state object is the request's: a row removed and added again (preemption) resumes from its mu; a fresh
    request starts at 2 * tau."""
    p = SamplingParams(mirostat=2, mirostat_tau=4.0)
    carried = MirostatState(1.25)
    state = SamplingState(1, V, torch.device("cpu"))
    state.add_request(0, p, [1], [], 3, carried)
    x = zipf_logits(random.Random(0)).unsqueeze(0)
    Sampler()(x.clone(), state.metadata([0]))
    after = carried.mu
    assert after != 1.25
    state.remove_request(0)
    state.add_request(0, p, [1], [7], 3, carried)
    assert state.metadata([0]).mirostat.mu.item() == pytest.approx(after)
    from tokenspout.core.request import Request
    from tokenspout.engine.messages import EngineCoreRequest
    req = Request(EngineCoreRequest("r", [1, 2], p), seed=1, max_model_len=64)
    assert req.mirostat is not None and req.mirostat.mu == 8.0
    assert Request(EngineCoreRequest("s", [1], SamplingParams()), seed=1, max_model_len=64).mirostat is None


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "torch"])
@pytest.mark.parametrize("mode,mu", [(2, 4.0), (2, 7.5), (1, 6.0), (1, 10.0), (1, 11.0)])  # mu 10: k 186, 11: all 300
def test_draws_match_the_truncated_distribution(mode: int, mu: float, kernel: bool) -> None:
    """One step, N seeds, the same mu: chi-square against the reference's kept distribution (and a different mu's
    must fail)."""
    n = 12_000
    x = zipf_logits(random.Random(42)) * 1.6
    state = SamplingState(n, V, torch.device("cpu"))
    p = SamplingParams(mirostat=mode)
    for i in range(n):
        state.add_request(i, p, [1], [], 1_000_003 * i, MirostatState(mu))
    meta = state.metadata(list(range(n)))
    assert meta.mirostat is not None and meta.mirostat.kernel_rows == list(range(n))
    ids = Sampler(cpu_kernel=kernel)(x.expand(n, V).contiguous(), meta).sampled_token_ids

    def target(m: float) -> np.ndarray:
        keep = ref_keep(x.double().tolist(), mode, m)
        w = torch.zeros(V, dtype=torch.float64)
        w[keep] = x.double()[keep].softmax(-1)
        return w.numpy()

    assert gof(ids, target(mu)) > 1e-3
    assert gof(ids, target(mu - 1.5)) < 1e-3


def test_mirostat_excludes_other_truncation() -> None:
    with pytest.raises(ValueError, match="^mirostat .*top_p"):
        SamplingParams(mirostat=2, top_p=0.9)
    with pytest.raises(ValueError, match="^mirostat "):
        SamplingParams(mirostat=3)
    assert SamplingParams(mirostat=1, temperature=0.8, repetition_penalty=1.1).depends_on_output(0)
