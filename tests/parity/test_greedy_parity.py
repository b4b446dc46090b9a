"""Greedy parity with transformers (the outside oracle), with continuous batching and chunked prefill forced on."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers import make_core, run_to_completion
from tokenspout.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Hi",
    "Write a haiku about the sea.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "1, 2, 3, 4, 5,",
    ("Once upon a time, in a land far away, there lived a king who had three daughters. The eldest was wise, "
    "the second was brave, and the youngest was kind. One day the king fell ill and"),
    "Translate to French: The weather is nice today and I would like to go for a walk in the park with my dog.",
    ("Explain in detail why the sky is blue, covering Rayleigh scattering, the wavelength dependence of scattering, "
    "why sunsets are red, and why the sky is not violet even though violet light scatters more than blue light. "
    "Give the physical intuition first, then the formula."),
]
NEW_TOKENS = 32
NEAR_TIE = 1e-4
LOGIT_TOL = 1e-3


def hf_greedy(hf_model, ids: list[int], n: int):
    x = torch.tensor([ids])
    with torch.no_grad():
        g = hf_model.generate(x, max_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True,
                              eos_token_id=2, pad_token_id=2)
    return g.sequences[0, len(ids):].tolist(), [s[0].float() for s in g.logits]


def check_parity(ours: list[int], ref: list[int], ref_logits: list[torch.Tensor], label: str) -> None:
    """Exact token match; a divergence is accepted only at a reported near-tie of the reference logits."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = ref_logits[i].topk(2).values
            gap = float(top2[0] - top2[1])
            if gap < NEAR_TIE:
                warnings.warn(f"{label}: tokens diverge at step {i} ({a} vs {b}) at a near-tie, gap {gap:.2e}",
                              stacklevel=2)
                return
            pytest.fail(f"{label}: token {i} differs ({a} vs {b}); reference top-2 gap {gap:.3e}")
    assert len(ours) == len(ref), f"{label}: length {len(ours)} vs {len(ref)}"


def test_greedy_parity_batched_chunked(loaded_model, hf_model, tokenizer):
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    assert max(len(p) for p in prompts) > 40  # the budget below forces chunked prefill
    core = make_core(loaded_model, budget=40)
    captured: dict[str, list[torch.Tensor]] = {}
    core.runner.logits_hook = lambda ids, lg: [captured.setdefault(r, []).append(lg[i].clone())
                                               for i, r in enumerate(ids)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, eos_token_id=2)
    ours = run_to_completion(core, prompts, params)
    for i, ids in enumerate(prompts):
        ref, ref_logits = hf_greedy(hf_model, ids, NEW_TOKENS)
        check_parity(ours[str(i)], ref, ref_logits, f"prompt {i}")
        # Last-position logits of the prompt (and of every later step while tokens agree) within 1e-3.
        for step, (mine, theirs) in enumerate(zip(captured[str(i)], ref_logits)):
            if step and ours[str(i)][step - 1] != ref[step - 1]:
                break
            err = (mine - theirs).abs().max().item()
            assert err < LOGIT_TOL, f"prompt {i} step {step}: max logit error {err:.2e}"


def test_chunked_prefill_matches_unchunked(loaded_model, tokenizer):
    long_prompt = tokenizer(" ".join(PROMPTS) * 3).input_ids
    assert len(long_prompt) > 300
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    whole = run_to_completion(make_core(loaded_model, budget=1024), [long_prompt], params)
    chunked = run_to_completion(make_core(loaded_model, budget=64), [long_prompt], params)
    assert chunked == whole


def test_preemption_keeps_every_request_exact(loaded_model, tokenizer):
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    free = run_to_completion(make_core(loaded_model, budget=256), prompts, params)
    # 12 blocks of 16 tokens cannot hold 8 requests of up to ~90 tokens at once: the scheduler must preempt.
    core = make_core(loaded_model, budget=256, num_blocks=12)
    pressured = run_to_completion(core, prompts, params)
    assert core.scheduler.num_preemptions > 0
    assert pressured == free
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_mid_prefill_request_samples_nothing(loaded_model, tokenizer):
    core = make_core(loaded_model, budget=16)
    ids = tokenizer(PROMPTS[7]).input_ids
    from tokenspout.engine.messages import EngineCoreRequest

    core.add_request(EngineCoreRequest("r", ids, SamplingParams(temperature=0.0, max_tokens=2)))
    steps_without_output = 0
    while True:
        out = core.step().outputs
        if out:
            break
        steps_without_output += 1
    assert steps_without_output == -(-len(ids) // 16) - 1
