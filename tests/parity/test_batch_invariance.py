"""--batch-invariant (ModelConfig.batch_invariant): a request's tokens and logprobs are bit-identical whether it runs
alone or among other requests -- a long prompt chunked across the steps it decodes in, seeded and greedy requests
of other lengths arriving and finishing around it, its own prompt chunked by another step budget -- with float32 and
with int4 weights, and with n-gram and self-draft speculation (tokens only there: a request asking for logprobs does
not draft).  The oracle is the same request alone.  (Without the flag the C kernels' summation order depends
on the rows a step holds, so logprobs move by ~1e-3 and a seeded request can take another token at a near-tie.)"""

from __future__ import annotations

import dataclasses

import pytest

from tests.helpers import make_core
from tokenspout.config import ModelConfig, SpeculativeConfig
from tokenspout.engine.messages import EngineCoreRequest
from tokenspout.kernels import cpu
from tokenspout.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(cpu.load(invariant=True) is None, reason="no C kernels on this machine")

TARGETS = {"sampled": SamplingParams(temperature=1.0, seed=7, max_tokens=20, logprobs=5),
           "greedy": SamplingParams(temperature=0.0, max_tokens=20, logprobs=5)}


@pytest.fixture(scope="module")
def int4_model(model_path):
    from tokenspout.models.loader import load_model

    return load_model(ModelConfig(model=str(model_path), max_model_len=1024, quantization="int4"))


def _run(core, requests: list[tuple[str, list[int], SamplingParams, int]]) -> dict[str, tuple[list, list]]:
    """requests: (id, prompt ids, params, the step before which it is added); returns {id: (tokens, logprobs)}."""
    out: dict[str, tuple[list, list]] = {rid: ([], []) for rid, *_ in requests}
    for step in range(2000):
        for rid, ids, params, at in requests:
            if at == step:
                core.add_request(EngineCoreRequest(rid, ids, params))
        if step > max(at for *_, at in requests) and not core.has_unfinished_requests():
            return out
        for o in core.step().outputs:
            toks, lps = out[o.request_id]
            toks.extend(o.new_token_ids)
            lps.extend((lp.logprob, lp.top_token_ids, lp.top_logprobs) for lp in o.new_logprobs or ())
    raise AssertionError("requests did not finish")


# adaptive off: every eligible request drafts at every step (the adaptive policy stops drafting where drafts are
# rejected); how many drafts a request verifies still depends on the step's others
SPECULATION = {"ngram": SpeculativeConfig(method="ngram", adaptive=False),
               "self-draft": SpeculativeConfig(method="draft", draft_layers=24, adaptive=False)}


@pytest.mark.parametrize(("weights", "spec"), [("float32", None), ("int4", None), ("int4", "ngram"),
                                               ("int4", "self-draft")])
def test_a_request_alone_and_among_others_gets_the_same_bits(request, tokenizer, weights, spec):
    loaded = request.getfixturevalue("loaded_model" if weights == "float32" else "int4_model")
    text = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    if spec == "ngram":  # (text that repeats, so that the n-gram proposer finds drafts)
        text = "Repeat after me: the cat sat on the mat. the cat sat on the mat. the cat sat on the mat."
    prompt = tokenizer(text).input_ids
    speculative = SPECULATION[spec] if spec else None
    targets = {name: dataclasses.replace(p, logprobs=None) if spec else p for name, p in TARGETS.items()}
    alone = {}
    core = make_core(loaded, budget=512, batch_invariant=True, speculative=speculative)
    for name, params in targets.items():
        alone[name] = _run(core, [(name, prompt, params, 0)])[name]
        assert len(alone[name][0]) == 20
    long_prompt = tokenizer(" ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(40))
                            ).input_ids
    assert len(long_prompt) > 300
    others = [("long0", long_prompt, SamplingParams(temperature=0.8, seed=1, max_tokens=6), 0),
              ("long1", long_prompt[::-1], SamplingParams(temperature=0.0, max_tokens=4), 6)]
    for i in range(6):
        ids = tokenizer(f"Question {i}: what is {i} times {i + 3}?" * (1 + i % 3)).input_ids
        others.append((f"short{i}", ids, SamplingParams(temperature=1.0, seed=100 + i, max_tokens=3 + 4 * i), i % 4))
    # a budget of 96 tokens: long prompts are chunked, prefill chunks share the steps the targets decode in, the
    # number of rows in a step changes from step to step, and steps are larger than the 64 tokens from which a
    # float32 model's steps would otherwise go to the torch model
    crowd_core = make_core(loaded, budget=96, batch_invariant=True, speculative=speculative)
    crowd = _run(crowd_core, [*others, *((name, prompt, params, 2) for name, params in targets.items())])
    if spec:  # drafts were verified, and some accepted, in both runs
        for c in (core, crowd_core):
            assert c.stats().spec_num_accepted_tokens > 0
    for name in TARGETS:
        assert crowd[name][0] == alone[name][0], name
        assert crowd[name][1] == alone[name][1], name


def test_batch_invariant_needs_int16_activations_and_the_kernels(loaded_model, monkeypatch):
    with pytest.raises(ValueError, match="activation_quant int16"):
        ModelConfig(batch_invariant=True, activation_quant="int8").validate()
    with pytest.raises(ValueError, match="batch_invariant must be a bool"):
        ModelConfig(batch_invariant="yes").validate()  # type: ignore[arg-type]
    monkeypatch.setenv("TOKENSPOUT_KERNELS", "0")
    with pytest.raises(ValueError, match="--batch-invariant needs the C kernels"):
        make_core(loaded_model, batch_invariant=True)
