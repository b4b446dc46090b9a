"""Mirostat 1 and 2 (llama.cpp's llama_sampler_mirostat / llama_sampler_mirostat_v2, from the Mirostat paper), per row.

Each request carries its running surprise target mu (MirostatState, owned by core.request.Request so that it survives
preemption; the sampling state holds a reference to it while the request has a row).  mu starts at 2 * tau.  Each
step, on the row's distribution after temperature (mirostat replaces top-k / top-p / min-p and the warpers, as in
llama.cpp's chain, so those are a 400 together with it):
- v2: keep the tokens with surprise -log2 p <= mu (at least the most likely one);
- v1: estimate the Zipf exponent s from the 100 most likely tokens (least squares of log(p_i / p_i+1) on
  log((i + 2) / (i + 1))), take k = ((s - 1) * 2^mu / (1 - V^(1 - s))) ^ (1 / s) and keep the top max(int(k), 1);
then draw from the renormalised kept tokens and update mu <- mu - eta * (-log2 p(drawn) - tau), p renormalised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NEG_INF = float("-inf")
V1_M = 100  # llama.cpp's m: tokens used to estimate s


@dataclass(slots=True)
class MirostatState:
    mu: float

    @staticmethod
    def initial(mode: int, tau: float) -> MirostatState | None:
        return MirostatState(2.0 * tau) if mode else None


@dataclass(slots=True)
class MirostatBatch:
    """The mirostat rows of a step: their batch rows, knobs [M] and the requests' states (updated after the draw)."""

    rows: list[int]
    mode: torch.Tensor  # int64, 1 or 2
    tau: torch.Tensor  # float32
    eta: torch.Tensor
    mu: torch.Tensor  # float32, read from the states when the metadata was built
    states: list[MirostatState]
    kernel_rows: list[int]  # those the CPU kernel may draw (no processed logprobs)

    def select(self, keep: list[int]) -> MirostatBatch | None:
        """The rows at positions `keep` of this batch (None if none)."""
        if not keep:
            return None
        idx = torch.tensor(keep, dtype=torch.int64, device=self.tau.device)
        rows = [self.rows[i] for i in keep]
        return MirostatBatch(rows, self.mode[idx], self.tau[idx], self.eta[idx], self.mu[idx],
                             [self.states[i] for i in keep], [r for r in self.kernel_rows if r in set(rows)])


def keep_mask(y: torch.Tensor, mode: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """Keep mask [R, V] of mirostat rows y [R, V] (scaled logits, -inf where masked)."""
    logp = y.log_softmax(-1)
    top = y >= y.amax(-1, keepdim=True)
    keep2 = (-logp / math.log(2.0) <= mu.unsqueeze(-1)) | top
    if not bool((mode == 1).any()):
        return keep2
    vocab = y.shape[1]
    m = min(V1_M, vocab)
    lp_top = logp.topk(m, -1).values.double()  # descending
    i = torch.arange(m - 1, dtype=torch.float64, device=y.device)
    t = torch.log((i + 2) / (i + 1))
    b = lp_top[:, :-1] - lp_top[:, 1:]  # log(p_i / p_{i+1})
    b = torch.where(torch.isfinite(b), b, 0.0)  # tokens past the finite ones add nothing (llama.cpp: size - 1 bound)
    s_hat = (t * b).sum(-1) / (t * t).sum(-1)
    eps = s_hat - 1
    k = ((eps * torch.pow(2.0, mu.double())) / (1 - torch.pow(float(vocab), -eps))).pow(1 / s_hat)
    k = torch.nan_to_num(k, nan=1.0, posinf=float(vocab)).clamp(1, vocab).floor().long()
    kth = y.topk(m, -1).values.gather(1, (k.clamp(max=m) - 1).unsqueeze(-1))
    for r in (k > m).nonzero().flatten().tolist():  # a wide k: one selection (not a sort) of the row
        kth[r, 0] = y[r].kthvalue(vocab - int(k[r]) + 1).values
    keep1 = y >= kth  # ties at the k-th value all stay, as top-k does here
    return torch.where((mode == 1).unsqueeze(-1), keep1, keep2)


def update(states: list[MirostatState], kept_logits: torch.Tensor, drawn: torch.Tensor, tau: torch.Tensor,
           eta: torch.Tensor) -> torch.Tensor:
    """mu <- mu - eta * (surprise of the drawn token in the kept distribution - tau); writes the states, returns
    the new mu [M]."""
    lp = kept_logits.log_softmax(-1).gather(1, drawn.unsqueeze(-1)).squeeze(-1).double()
    return update_from_logprobs(states, lp, tau, eta)


def update_from_logprobs(states: list[MirostatState], lp: torch.Tensor, tau: torch.Tensor,
                         eta: torch.Tensor) -> torch.Tensor:
    """update() given the drawn tokens' log probabilities among the kept ones (natural log) [M].  The states live
    on the host: on an accelerator this reads M values back (steps with mirostat rows only)."""
    lp, tau, eta = lp.double().cpu(), tau.double().cpu(), eta.double().cpu()
    mu = torch.tensor([s.mu for s in states], dtype=torch.float64)
    new = mu - eta.double() * (-lp / math.log(2.0) - tau.double())
    for s, v in zip(states, new.tolist()):
        s.mu = v
    return new
