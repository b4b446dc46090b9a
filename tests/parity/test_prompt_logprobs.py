"""Prompt logprobs against transformers (the outside oracle): the engine scores every prompt token on the prefill's
own logits, and they must equal log_softmax of transformers' float32 logits at the same positions within 1e-3, with
the same ranks and top-k ids, however the prefill is cut (chunked prefill, a batch with other requests, prefix-cache
hits possible, async scheduling, speculative decoding) and with max_tokens=0.

The engine is the float32 default model without quantization (the conftest `loaded_model`), the same weights
transformers loads.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import make_core
from tokenspout.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from tokenspout.core.engine_core import EngineCore
from tokenspout.engine.messages import EngineCoreRequest, PromptLogprobs
from tokenspout.engine.output_processor import OutputProcessor
from tokenspout.sampling_params import SamplingParams

PROMPTS = [
    "Hi there",
    "The capital of France is Paris, and the capital of Italy is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n",
    ("Once upon a time, in a land far away, there lived a king who had three daughters. The eldest was wise, "
     "the second was brave, and the youngest was kind. One day the king fell ill and called his daughters to his "
     "bed. He told them that whoever brought him the water of life would inherit the kingdom."),
]
TOL = 1e-3
NEAR_TIE = 1e-4  # reference logprobs closer than this may order either way
K = 5


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    ids = [tokenizer(p).input_ids for p in PROMPTS]
    assert len({len(p) for p in ids}) == 4 and max(len(p) for p in ids) > 64
    return ids


@pytest.fixture(scope="module")
def reference(hf_model, prompts) -> list[torch.Tensor]:
    """transformers' float32 log_softmax at every prompt position, [P, V] per prompt."""
    with torch.no_grad():
        return [torch.log_softmax(hf_model(torch.tensor([p])).logits[0].float(), dim=-1) for p in prompts]


def _run(core: EngineCore, reqs: list[tuple[str, list[int], SamplingParams]], max_steps: int = 5000):
    """Steps until every request finishes; per request (its prompt logprobs chunks, tokens, finish reason, cached)."""
    for rid, ids, params in reqs:
        core.add_request(EngineCoreRequest(rid, ids, params))
    res = {rid: ([], [], None, 0) for rid, _, _ in reqs}
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            break
        for o in core.step().outputs:
            chunks, toks, fin, _ = res[o.request_id]
            assert fin is None, "output after finish"
            if o.prompt_logprobs is not None:
                chunks.append(o.prompt_logprobs)
            toks.extend(o.new_token_ids)
            res[o.request_id] = (chunks, toks, o.finish_reason, max(o.num_cached_tokens, res[o.request_id][3]))
    assert all(r[2] is not None for r in res.values()), "not every request finished"
    return res


def _check(chunks: list[PromptLogprobs], ids: list[int], ref: torch.Tensor, k: int, label: str) -> None:
    """The chunks cover positions 0..P-2 once, in order, and match the reference."""
    pos = 0
    for c in chunks:
        assert c.start == pos, f"{label}: chunk starts at {c.start}, expected {pos}"
        assert len(c.top_token_ids) == len(c.top_logprobs) == k * len(c.logprobs)
        for j, (lp, rank) in enumerate(zip(c.logprobs, c.ranks)):
            p = pos + j
            row, target = ref[p], ids[p + 1]
            want = float(row[target])
            assert abs(lp - want) < TOL, f"{label} position {p}: logprob {lp:.5f} vs {want:.5f}"
            # rank as vLLM counts it: tokens at least as likely; outside near-ties it must match exactly
            lo, hi = int((row >= want + NEAR_TIE).sum()) + 1, int((row >= want - NEAR_TIE).sum())
            assert lo <= rank <= hi, f"{label} position {p}: rank {rank}, reference {lo}..{hi}"
            top_ids, top_lps = c.top_token_ids[j * k : (j + 1) * k], c.top_logprobs[j * k : (j + 1) * k]
            ref_lp, ref_ids = row.topk(k)
            for i in range(k):
                assert abs(top_lps[i] - float(ref_lp[i])) < TOL, f"{label} position {p}: top-{i} value"
                if top_ids[i] != int(ref_ids[i]):  # only a near-tie may swap ids
                    assert abs(float(row[top_ids[i]]) - float(ref_lp[i])) < NEAR_TIE, \
                        f"{label} position {p}: top-{i} id {top_ids[i]} vs {int(ref_ids[i])}"
        pos += len(c.logprobs)
    assert pos == len(ids) - 1, f"{label}: scored {pos} positions of {len(ids) - 1}"


def _greedy(k: int | None = K, max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, prompt_logprobs=k, ignore_eos=True)


@pytest.mark.parametrize("budget", [512, 16], ids=["whole", "chunked"])
def test_matches_transformers(loaded_model, prompts, reference, budget):
    """Alone per step or chunked over several steps (budget 16: the longest prompt spans 4+ steps)."""
    core = make_core(loaded_model, budget=budget)
    res = _run(core, [(str(i), p, _greedy()) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        chunks, toks, fin, _ = res[str(i)]
        if budget == 16 and len(p) > 32:
            assert len(chunks) > 1
        _check(chunks, p, reference[i], K, f"prompt {i}")
        assert len(toks) == 4 and fin == "length"


def test_k0_and_batch_with_requests_that_do_not_ask(loaded_model, prompts, reference):
    """k=0 (the prompt token alone) next to plain requests and requests with sampled-token logprobs: those get no
    prompt logprobs and the same tokens as without the neighbours."""
    core = make_core(loaded_model, budget=48)
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    sampled_lp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    reqs = [(f"s{i}", p, _greedy(0)) for i, p in enumerate(prompts)]
    reqs += [(f"p{i}", p, plain if i % 2 else sampled_lp) for i, p in enumerate(prompts)]
    res = _run(core, reqs)
    alone = _run(make_core(loaded_model, budget=48), [(f"p{i}", p, plain) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        _check(res[f"s{i}"][0], p, reference[i], 0, f"prompt {i}")
        assert res[f"p{i}"][0] == []
        assert res[f"p{i}"][1] == alone[f"p{i}"][1] == res[f"s{i}"][1]


def test_prefix_cache_hit_is_not_taken(loaded_model, prompts, reference):
    """A cached prompt would skip positions it must score: the request takes no hit and scores all of them, while a
    request that does not ask still takes the hit."""
    core = make_core(loaded_model, budget=512, prefix_caching=True)
    long = prompts[3]
    _run(core, [("warm", long, SamplingParams(temperature=0.0, max_tokens=1))])
    res = _run(core, [("scored", long, _greedy(2))])
    chunks, _, _, cached = res["scored"]
    assert cached == 0
    _check(chunks, long, reference[3], 2, "scored after warm-up")
    again = _run(core, [("plain", long, SamplingParams(temperature=0.0, max_tokens=1))])
    assert again["plain"][3] >= 16, "the cache still serves requests that do not ask"


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(loaded_model, prompts, reference):
    for budget in (512, 16):
        core = make_core(loaded_model, budget=budget)
        res = _run(core, [(str(i), p, _greedy(K, max_tokens=0)) for i, p in enumerate(prompts)])
        for i, p in enumerate(prompts):
            chunks, toks, fin, _ = res[str(i)]
            assert toks == [] and fin == "length"
            _check(chunks, p, reference[i], K, f"prompt {i} budget {budget}")
        assert core.kv.num_free_blocks == core.kv.num_blocks  # every finished request gave its blocks back


def test_async_scheduling(loaded_model, prompts, reference):
    """With the next step prepared while one runs: same scores, same tokens as synchronous, max_tokens=0 too."""
    reqs = [(str(i), p, _greedy(K, max_tokens=0 if i == 1 else 3)) for i, p in enumerate(prompts)]
    res = _run(make_core(loaded_model, budget=16, async_scheduling=True), reqs)
    sync = _run(make_core(loaded_model, budget=16), reqs)
    for i, p in enumerate(prompts):
        _check(res[str(i)][0], p, reference[i], K, f"prompt {i}")
        assert res[str(i)][1:3] == sync[str(i)][1:3]


def test_speculative_decoding(loaded_model, prompts, reference):
    """n-gram speculation on: prompt scores unchanged and the tokens equal those without speculation."""
    cfg = EngineConfig(model=ModelConfig(model=str(loaded_model.path), max_model_len=loaded_model.max_model_len),
                       cache=CacheConfig(), scheduler=SchedulerConfig(max_num_batched_tokens=32),
                       speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    reqs = [(str(i), p, _greedy(K, max_tokens=0 if i == 0 else 12)) for i, p in enumerate(prompts)]
    res = _run(EngineCore(cfg, loaded=loaded_model), reqs)
    plain = _run(make_core(loaded_model, budget=32), reqs)
    for i, p in enumerate(prompts):
        _check(res[str(i)][0], p, reference[i], K, f"prompt {i}")
        assert res[str(i)][1:3] == plain[str(i)][1:3]


def test_preempted_request_sends_each_position_once(loaded_model, prompts, reference):
    """A KV cache too small for all requests preempts and recomputes; each position is still sent once."""
    core = make_core(loaded_model, budget=32, num_blocks=14, block_size=16)
    reqs = [(str(i), prompts[3], _greedy(1, max_tokens=40)) for i in range(3)]
    res = _run(core, reqs)
    assert core.scheduler.num_preemptions > 0
    for i in range(3):
        _check(res[str(i)][0], prompts[3], reference[3], 1, f"request {i}")


def test_request_output_shape(loaded_model, prompts, reference, tokenizer):
    """The frontend's RequestOutput.prompt_logprobs: one entry per prompt token, the first None; each a dict whose
    first key is the prompt token (its rank and decoded text), then the top-k ranked 1..k."""
    core = make_core(loaded_model, budget=16)
    op = OutputProcessor(tokenizer)
    p = prompts[1]
    req = EngineCoreRequest("r", p, _greedy(2, max_tokens=2))
    op.add_request(req, None)
    core.add_request(req)
    outs = []
    while core.has_unfinished_requests():
        outs += op.process_outputs(core.step().outputs).request_outputs
    final = outs[-1]
    assert final.finished
    plp = final.prompt_logprobs
    assert plp is not None and len(plp) == len(p) and plp[0] is None
    for i in range(1, len(p)):
        pos = plp[i]
        first_id, first = next(iter(pos.items()))
        assert first_id == p[i]
        assert abs(first.logprob - float(reference[1][i - 1, p[i]])) < TOL
        assert first.decoded_token == tokenizer.decode([p[i]])
        ranked = [lp.rank for tid, lp in pos.items() if tid != p[i]]
        assert ranked == [r for r in (1, 2) if r in ranked] and 1 <= len(pos) <= 3


@pytest.mark.parametrize("kwargs", [{"prompt_logprobs": -1}, {"prompt_logprobs": 21}, {"max_tokens": 0},
                                    {"max_tokens": -1, "prompt_logprobs": 1}])
def test_invalid(kwargs):
    field = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**kwargs)
