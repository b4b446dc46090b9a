"""Seeded draws are batch-invariant (DESIGN invariant 5) and the incremental state equals a rebuild."""

from __future__ import annotations

import random

import torch

from tokenspout.sample.ops.topk_topp import TierConfig
from tokenspout.sample.sampler import Sampler, compute_processed_logits
from tokenspout.sampling_params import SamplingParams
from tokenspout.worker.sampling_state import SamplingState, build_metadata

V = 8192
STEPS = 4
# Small tiers, so that at this vocabulary the targets and their neighbours go through every path
# (first candidate set with batch-dependent K, second set, full sort, dense).
TIERS = TierConfig(first_k=32, first_cap=256, later_k=(1024,), block_size=64)


def step_logits(req: int, pos: int, scale: float) -> torch.Tensor:
    """The 'model': logits of request `req` at output position `pos`, independent of any batch."""
    gen = torch.Generator().manual_seed(req * 100_003 + pos)
    return torch.randn(V, generator=gen) * scale


TARGETS = [
    (SamplingParams(temperature=0.9, seed=11), 3.0),
    (SamplingParams(top_p=0.9, seed=12), 3.0),
    (SamplingParams(top_p=0.9, seed=13), 0.5),  # nucleus of thousands: fallback tiers
    (SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=14), 2.0),
    (SamplingParams(min_p=0.05, seed=15), 2.5),
    (SamplingParams(top_p=0.95, repetition_penalty=1.3, frequency_penalty=0.5, seed=16), 3.0),
]


def neighbour(rng: random.Random) -> tuple[SamplingParams, float]:
    p = rng.choice([
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=rng.choice([5, 100, 200, 2000]), top_p=0.8),
        SamplingParams(top_p=rng.choice([0.5, 0.99])),
        SamplingParams(min_p=0.2, presence_penalty=1.0),
        SamplingParams(temperature=1.2),
    ])
    return p, rng.choice([0.5, 2.0, 4.0])


def generate(targets: dict[int, int], batch: int, layout_seed: int) -> dict[int, list[int]]:
    """Runs a batch for STEPS steps with target t at row targets[t] and random neighbours elsewhere;
    returns each target's tokens."""
    rng = random.Random(layout_seed)
    reqs = [neighbour(rng) for _ in range(batch)]
    for t, row in targets.items():
        reqs[row] = TARGETS[t]
    req_of_row = {row: -1 - t for t, row in targets.items()}  # a target's logits do not depend on its row
    state = SamplingState(batch, V, torch.device("cpu"))
    slots = list(range(batch))
    rng.shuffle(slots)  # rows map to arbitrary slots
    for r, (p, _) in enumerate(reqs):
        state.add_request(slots[r], p, [1, 2, 3], [], p.seed if p.seed is not None else rng.randrange(1 << 62))
    sampler = Sampler(TIERS)
    out: dict[int, list[int]] = {t: [] for t in targets}
    for pos in range(STEPS):
        logits = torch.stack([step_logits(req_of_row.get(r, r), pos, reqs[r][1]) for r in range(batch)])
        ids = sampler(logits, state.metadata(slots)).sampled_token_ids.tolist()
        for t, row in targets.items():
            out[t].append(ids[row])
        state.append_tokens(slots, [[i] for i in ids])
    return out


def test_seeded_requests_are_batch_invariant() -> None:
    alone = {t: generate({t: 0}, 1, 0)[t] for t in range(len(TARGETS))}
    layouts = [
        {0: 0, 1: 37, 2: 5, 3: 63, 4: 20, 5: 21},
        {0: 37, 1: 0, 2: 36, 3: 1, 4: 50, 5: 9},
        {0: 12, 1: 13, 2: 0, 3: 37, 4: 38, 5: 2},
    ]
    for i, layout in enumerate(layouts):
        got = generate(layout, 64, i + 1)
        for t in layout:
            assert got[t] == alone[t], f"target {t} ({TARGETS[t][0]}) at row {layout[t]} of layout {i}"


def test_different_seeds_differ() -> None:
    sampler = Sampler(TIERS)
    x = step_logits(0, 0, 0.5).expand(8, V).contiguous()
    ids = sampler(x, build_metadata([SamplingParams(top_p=0.9, seed=s) for s in range(8)], V)).sampled_token_ids
    assert len(set(ids.tolist())) >= 7  # nucleus of thousands of tokens: collisions are rare


def test_preempted_and_resumed_request_draws_the_same() -> None:
    p, scale = TARGETS[5]
    sampler = Sampler(TIERS)

    def run(resume_at: int | None) -> list[int]:
        state = SamplingState(4, V, torch.device("cpu"))
        state.add_request(0, p, [1, 2, 3], [], seed=99)
        out: list[int] = []
        slot = 0
        for pos in range(STEPS):
            if pos == resume_at:  # preempted: freed, later re-added at another slot with the output so far
                state.remove_request(slot)
                slot = 3
                state.add_request(slot, p, [1, 2, 3], list(out), seed=99)
            tok = sampler(step_logits(-1, pos, scale)[None], state.metadata([slot])).sampled_token_ids.item()
            out.append(tok)
            state.append_tokens([slot], [[tok]])
        return out

    assert run(None) == run(3)


def test_incremental_counts_equal_rebuild() -> None:
    rng = random.Random(0)
    vocab = 1000
    p = SamplingParams(repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=0.3)
    state = SamplingState(8, vocab, torch.device("cpu"))
    prompts = {s: [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))] for s in range(8)}
    outputs: dict[int, list[int]] = {s: [] for s in range(8)}
    for s in range(8):
        state.add_request(s, p if s != 5 else SamplingParams(), prompts[s], [], seed=s)
    for _ in range(120):  # enough distinct tokens to outgrow the initial capacity of 256 columns
        slots = rng.sample(range(8), 5)
        toks = [[rng.randrange(vocab) for _ in range(rng.choice([1, 1, 3]))] for _ in slots]
        state.append_tokens(slots, toks)
        for s, t in zip(slots, toks):
            outputs[s] += t
    for s in range(8):
        if s == 5:
            continue
        counts, seen = state.output_counts(s)
        ref = torch.bincount(torch.tensor(outputs[s], dtype=torch.int64), minlength=vocab).float()
        assert torch.equal(counts, ref)
        ref_seen = torch.zeros(vocab, dtype=torch.bool)
        ref_seen[prompts[s] + outputs[s]] = True
        assert torch.equal(seen, ref_seen)
    # The penalties computed from the incremental state equal those of a state built from scratch.
    slots = [0, 1, 2, 3, 4, 5, 6, 7]
    x = torch.randn(8, vocab)
    rebuilt = build_metadata(
        [p if s != 5 else SamplingParams() for s in slots], vocab,
        prompts=[prompts[s] for s in slots], outputs=[outputs[s] for s in slots], seeds=slots,
    )
    assert torch.equal(compute_processed_logits(x, state.metadata(slots)), compute_processed_logits(x, rebuilt))
