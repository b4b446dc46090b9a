"""SamplingState.metadata reuses the last step's metadata for the same requests: it must always equal a fresh
build (positions advance, min_tokens bans lift, a slot reused by another request is rebuilt)."""

from __future__ import annotations

import dataclasses

import torch

from tokenspout.sampling_params import SamplingParams
from tokenspout.worker.sampling_state import SamplingState


def _same(a, b) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f.name
        elif isinstance(x, tuple):
            assert all(torch.equal(p, q) for p, q in zip(x, y)), f.name
        elif f.name == "penalties":
            assert (x is None) == (y is None), f.name
        else:
            assert x == y, f.name


def test_reused_metadata_equals_a_fresh_build():
    st = SamplingState(4, 100, torch.device("cpu"))
    st.add_request(0, SamplingParams(temperature=0.8, top_k=20, seed=1, logprobs=2), [1, 2], [], 1)
    st.add_request(1, SamplingParams(temperature=0.0), [3], [], 2)
    st.add_request(2, SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[7], logit_bias={5: 2.0}),
                   [4], [], 3)
    slots = [0, 1, 2]
    first = st.metadata(slots)
    first.grammar_bitmask = torch.zeros(3, 4, dtype=torch.int32)  # the caller's own field: never carried over
    for step in range(4):
        st.append_tokens(slots, [[10 + step]] * 3)
        md = st.metadata(slots)
        _same(md, st._build(slots)[0])
        assert md.grammar_bitmask is None
        assert md.positions.tolist() == [step + 1] * 3
        assert (md.banned is not None) == (step == 0)  # slot 2's stop id is banned until it has 2 tokens
    assert st._last is not None and st._last[1].banned is None  # cached once nothing follows the tokens
    # slot 1 goes to another request: same slots, new knobs
    st.remove_request(1)
    st.add_request(1, SamplingParams(temperature=0.5, top_p=0.9, seed=9), [5], [], 4)
    md = st.metadata(slots)
    _same(md, st._build(slots)[0])
    assert md.temperature[1].item() == 0.5 and not md.is_greedy[1]
