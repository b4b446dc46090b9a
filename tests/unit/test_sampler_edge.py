"""Edge cases of the sampler: greedy guards, extreme settings, masks, biases, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

import tokenspout.sample.sampler as sampler_mod
from tokenspout.sample.ops.topk_topp import TierConfig
from tokenspout.sample.sampler import Sampler, compute_processed_logits
from tokenspout.sampling_params import SamplingParams
from tokenspout.worker.sampling_state import SamplingState, build_metadata

NEG_INF = float("-inf")
V = 512


def logits_for(rows: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * scale


def sample(x: torch.Tensor, params: list[SamplingParams], **kw: object) -> torch.Tensor:
    return Sampler()(x.clone(), build_metadata(params, V, **kw)).sampled_token_ids  # type: ignore[arg-type]


def reference_processed(x: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Brute force, one row, DESIGN order; full sort for the truncation."""
    y = x.clone()
    if p.allowed_token_ids is not None:
        keep = torch.zeros(V, dtype=torch.bool)
        keep[p.allowed_token_ids] = True
        y[~keep] = NEG_INF
    for word in p.bad_words_token_ids or []:
        if len(word) == 1 or output[len(output) - len(word) + 1 :] == word[:-1] and len(output) >= len(word) - 1:
            y[word[-1]] = NEG_INF
    if len(output) < p.min_tokens:
        for t in p.all_stop_token_ids:
            y[t] = NEG_INF
    for t, b in (p.logit_bias or {}).items():
        y[t] += max(-100.0, min(100.0, b))
    for t in set(prompt) | set(output):
        r = p.repetition_penalty
        y[t] = y[t] * r if y[t] < 0 else y[t] / r
    for t in set(output):
        y[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    if p.is_greedy:
        return y
    y = y / p.temperature
    ys, order = y.sort(descending=True, stable=True)
    w = (ys - ys[0]).exp()
    keep = w > 0
    if p.min_p:
        keep &= w >= p.min_p
    if p.top_k:
        keep &= ys >= ys[min(p.top_k, V) - 1]
    if p.top_p < 1:
        wa = w * keep
        keep &= (wa.cumsum(0) - wa) < p.top_p * wa.sum()
    out = torch.full_like(y, NEG_INF)
    out[order[keep]] = ys[keep]
    return out


@pytest.mark.parametrize("temperature", [0.0, 1e-6])
def test_greedy_temperatures_no_nan(temperature: float) -> None:
    x = logits_for(8)
    params = [SamplingParams(temperature=temperature, logprobs=3, logprobs_mode=m)
              for m in ("raw_logprobs", "processed_logprobs") for _ in range(4)]
    out = Sampler()(x.clone(), build_metadata(params, V))
    assert torch.equal(out.sampled_token_ids, x.argmax(-1))
    assert out.logprobs is not None and not out.logprobs.logprobs.isnan().any()
    mixed = [SamplingParams(temperature=temperature), SamplingParams(temperature=1.0)] * 4
    assert torch.equal(sample(x, mixed)[::2], x[::2].argmax(-1))
    assert not compute_processed_logits(x, build_metadata(mixed, V)).isnan().any()


def test_tiny_positive_temperature_is_sharp_not_nan() -> None:
    x = logits_for(4)
    ids = sample(x, [SamplingParams(temperature=2e-5, seed=s) for s in range(4)])
    assert torch.equal(ids, x.argmax(-1))


def test_top_k_larger_than_vocab_is_off() -> None:
    x = logits_for(2)
    a = compute_processed_logits(x, build_metadata([SamplingParams(top_k=V + 100)] * 2, V))
    b = compute_processed_logits(x, build_metadata([SamplingParams()] * 2, V))
    assert torch.equal(a, b)


def test_top_k_1_equals_greedy() -> None:
    x = logits_for(64, scale=0.5)  # flat rows: a wrong top-k would show
    ids = sample(x, [SamplingParams(top_k=1, seed=s) for s in range(64)])
    assert torch.equal(ids, x.argmax(-1))


def test_tiny_top_p_keeps_exactly_the_top_token() -> None:
    x = logits_for(16, scale=0.3)
    params = [SamplingParams(top_p=1e-9, seed=s) for s in range(16)]
    processed = compute_processed_logits(x, build_metadata(params, V))
    assert torch.equal((processed > NEG_INF).sum(-1), torch.ones(16, dtype=torch.int64))
    assert torch.equal(sample(x, params), x.argmax(-1))


def test_single_allowed_token() -> None:
    x = logits_for(4)
    params = [SamplingParams(allowed_token_ids=[123], seed=s, temperature=t) for s, t in enumerate((0, 1, 0.7, 2))]
    assert sample(x, params).tolist() == [123] * 4
    params = [SamplingParams(allowed_token_ids=[7], top_p=0.5, top_k=20, min_p=0.1)] * 2
    assert sample(x[:2], params).tolist() == [7, 7]


def test_all_greedy_batch_never_truncates_or_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kw: object) -> None:
        raise AssertionError("all-greedy batch reached the random path")

    monkeypatch.setattr(sampler_mod, "truncate", boom)
    monkeypatch.setattr(sampler_mod, "draw", boom)
    monkeypatch.setattr(torch, "sort", boom)
    monkeypatch.setattr(torch.Tensor, "sort", boom)
    monkeypatch.setattr(torch.Tensor, "topk", boom)
    x = logits_for(8)
    params = [SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2, repetition_penalty=1.2)] * 8
    out = Sampler()(x.clone(), build_metadata(params, V, prompts=[[1, 2]] * 8))
    assert out.sampled_token_ids.shape == (8,)


def test_every_row_different_settings_matches_brute_force() -> None:
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(top_p=0.6),
        SamplingParams(min_p=0.1, temperature=1.3),
        SamplingParams(top_k=30, top_p=0.9, min_p=0.02),
        SamplingParams(repetition_penalty=1.5, temperature=0.9),
        SamplingParams(presence_penalty=1.5, frequency_penalty=0.7),
        SamplingParams(logit_bias={3: 5.0, 9: -200.0, 11: 300.0}),
        SamplingParams(allowed_token_ids=[1, 2, 3, 50, 60], temperature=0.5),
        SamplingParams(bad_words_token_ids=[[4], [6, 7], [9, 10, 11]]),
        SamplingParams(min_tokens=5, eos_token_id=2, stop_token_ids=[8], top_k=3),
        SamplingParams(temperature=0.0, repetition_penalty=0.7, presence_penalty=-1.0),
        SamplingParams(temperature=1.5, top_p=0.95, repetition_penalty=1.2, frequency_penalty=0.5, min_p=0.05),
    ]
    rows = len(params)
    x = logits_for(rows, seed=3)
    x[:, 2] = 6.0  # make EOS tempting
    prompts = [[1, 2, 3, 4, 5, 6]] * rows
    outputs = [[6, 7, 9, 10, 3, 3, 3, 5]] * rows
    meta = build_metadata(params, V, prompts=prompts, outputs=outputs)
    for tiers in (None, TierConfig(first_k=2, first_cap=4, later_k=(8,), block_size=16)):
        got = compute_processed_logits(x, meta, tiers)
        for r, p in enumerate(params):
            ref = reference_processed(x[r], p, prompts[r], outputs[r])
            # Compare distributions (a token whose weight underflows to 0 may be -inf on one side only),
            # and the logits wherever the token has any probability.
            torch.testing.assert_close(got[r].softmax(-1), ref.softmax(-1), atol=1e-6, rtol=0, msg=f"row {r}: {p}")
            live = ref.softmax(-1) > 0
            torch.testing.assert_close(got[r][live], ref[live], atol=1e-5, rtol=1e-6, msg=f"row {r}: {p}")
    drawn = Sampler()(x.clone(), meta).sampled_token_ids
    for r in range(rows):
        assert got[r, drawn[r]] > NEG_INF, f"row {r} drew a dropped token"


def test_bad_words_multi_token_follow_the_output() -> None:
    p = SamplingParams(bad_words_token_ids=[[9], [5, 6, 7], [20, 21]])
    state = SamplingState(1, V, torch.device("cpu"))
    state.add_request(0, p, [5, 6], [], seed=0)

    def banned() -> set[int]:
        meta = state.metadata([0])
        return set() if meta.banned is None else set(meta.banned[1].tolist())

    assert banned() == {9}  # the prompt does not count: only the output so far
    state.append_tokens([0], [[5]])
    assert banned() == {9}
    state.append_tokens([0], [[6]])
    assert banned() == {9, 7}
    state.append_tokens([0], [[20]])
    assert banned() == {9, 21}
    x = torch.zeros(1, V)
    x[0, 21] = 50.0
    assert Sampler()(x, state.metadata([0])).sampled_token_ids.item() != 21


def test_min_tokens_bans_stop_tokens_until_reached() -> None:
    p = SamplingParams(min_tokens=2, eos_token_id=3, stop_token_ids=[4], temperature=0.0)
    state = SamplingState(2, V, torch.device("cpu"))
    state.add_request(0, p, [], [], seed=0)
    state.add_request(1, SamplingParams(min_tokens=2, eos_token_id=3, ignore_eos=True, temperature=0.0), [], [], 0)
    x = torch.zeros(2, V)
    x[:, 3] = 10.0
    x[:, 4] = 9.0
    x[:, 5] = 8.0
    for _ in range(2):
        assert state.metadata([0, 1]) is not None
        ids = Sampler()(x.clone(), state.metadata([0, 1])).sampled_token_ids.tolist()
        assert ids == [5, 3]  # ignore_eos: EOS is not a stop token, so it is not banned
        state.append_tokens([0, 1], [[5], [3]])
    assert Sampler()(x.clone(), state.metadata([0, 1])).sampled_token_ids.tolist() == [3, 3]


def test_logit_bias_added_and_clamped() -> None:
    x = logits_for(2)
    params = [SamplingParams(logit_bias={10: 1000.0, 11: -0.5}), SamplingParams(logit_bias={12: -1000.0})]
    got = compute_processed_logits(x, build_metadata(params, V))
    assert got[0, 10].item() == pytest.approx(x[0, 10].item() + 100.0)
    assert got[0, 11].item() == pytest.approx(x[0, 11].item() - 0.5)
    assert got[1, 12].item() == pytest.approx(x[1, 12].item() - 100.0)
    assert sample(x, [SamplingParams(logit_bias={77: 100.0}, seed=s) for s in range(2)]).tolist() == [77, 77]


def test_grammar_bitmask() -> None:
    x = logits_for(2)
    meta = build_metadata([SamplingParams(temperature=0.0), SamplingParams(seed=1)], V)
    words = math.ceil(V / 32)
    mask = torch.zeros(2, words, dtype=torch.int32)
    mask[0, 1] = 1 << 5  # token 37
    mask[1, 15] = -(1 << 31)  # bit 31 of word 15: token 511
    meta.grammar_bitmask = mask
    assert Sampler()(x.clone(), meta).sampled_token_ids.tolist() == [37, 511]


def test_all_masked_row_does_not_crash() -> None:
    p = SamplingParams(allowed_token_ids=[5], bad_words_token_ids=[[5]], top_p=0.9)
    q = SamplingParams(allowed_token_ids=[5], bad_words_token_ids=[[5]])
    out = Sampler()(logits_for(2), build_metadata([p, q], V))
    assert out.sampled_token_ids.shape == (2,)


def test_bf16_logits_are_cast() -> None:
    x = logits_for(4).bfloat16()
    ids = Sampler()(x, build_metadata([SamplingParams(temperature=0.0)] * 4, V)).sampled_token_ids
    assert torch.equal(ids, x.float().argmax(-1))


def test_logprobs_raw_and_processed_with_ranks() -> None:
    rows = 8
    x = logits_for(rows, seed=5)
    params = [
        SamplingParams(logprobs=n, logprobs_mode=mode, temperature=t, top_k=k, repetition_penalty=1.3, seed=r)
        for r, (n, mode, t, k) in enumerate([
            (5, "raw_logprobs", 0.7, 20), (0, "raw_logprobs", 1.0, 0), (20, "processed_logprobs", 0.7, 20),
            (3, "processed_logprobs", 0.0, 0), (None, "raw_logprobs", 1.0, 0), (2, "processed_logprobs", 1.5, 0),
            (1, "raw_logprobs", 0.0, 0), (4, "processed_logprobs", 1.0, 3),
        ])
    ]
    prompts = [[1, 2, 3]] * rows
    meta = build_metadata(params, V, prompts=prompts)
    processed = compute_processed_logits(x, meta)
    out = Sampler()(x.clone(), meta)
    lp = out.logprobs
    assert lp is not None and lp.token_ids.shape == (rows, 21) and lp.logprobs.shape == (rows, 21)
    for r, p in enumerate(params):
        if p.logprobs is None:
            continue
        full = (x[r] if p.logprobs_mode == "raw_logprobs" else processed[r]).log_softmax(-1)
        tok = int(out.sampled_token_ids[r])
        assert lp.token_ids[r, 0].item() == tok
        torch.testing.assert_close(lp.logprobs[r, 0], full[tok])
        assert lp.ranks[r].item() == int((full >= full[tok]).sum())  # brute-force rank
        n = p.logprobs
        ref_vals, ref_ids = full.sort(descending=True)
        torch.testing.assert_close(lp.logprobs[r, 1 : n + 1], ref_vals[:n])
        finite = ref_vals[:n] > NEG_INF
        assert lp.token_ids[r, 1 : n + 1][finite].tolist() == ref_ids[:n][finite].tolist()
    assert lp.ranks[3].item() == 1 and lp.ranks[6].item() == 1  # greedy rows sample the best token
    # Processed logprobs of a top_k=3 row: only three tokens are finite.
    assert int((lp.logprobs[7, 1:5] > NEG_INF).sum()) == 3
