"""The per-request speculation policy (spec_decode/policy.py): n-gram shadow rounds, draft-model back-off and probes,
the engine-wide prior, and fitting a batch's drafts to the small-step path."""

from __future__ import annotations

from tokenspout.config import SpeculativeConfig
from tokenspout.core.request import Request
from tokenspout.engine.messages import EngineCoreRequest
from tokenspout.sampling_params import SamplingParams
from tokenspout.spec_decode.policy import INITIAL_BACKOFF, SpecPolicy, SpecState

GREEDY = SamplingParams(temperature=0.0, max_tokens=1000)
SEEDED = SamplingParams(temperature=0.7, seed=3, max_tokens=1000)


def _req(rid: str = "r", params: SamplingParams = GREEDY) -> Request:
    return Request(EngineCoreRequest(rid, [1, 2, 3], params), 0, 4096)


def test_ngram_shadow_rounds_turn_drafting_back_on():
    pol = SpecPolicy(SpeculativeConfig(method="ngram"), 0.0, free_drafts=True)
    req = _req()
    assert not pol.wants_drafts(req, False)  # starts just below the bar: the first shadow round decides
    pol.shadow(req, [7, 8, 9, 10])
    req.token_ids += [7, 8, 9, 10]  # a round that would have emitted 5 tokens
    pol.shadow(req, [])
    assert pol.wants_drafts(req, False)
    for _ in range(4):
        pol.record(req, 1)  # rounds that emit one token: drafting does not pay
    assert not pol.wants_drafts(req, False)
    # Not drafting: the proposals are checked against what the target emits, for free.
    for _ in range(4):
        pol.shadow(req, [7, 8, 9, 10])
        req.token_ids += [7, 8, 9]  # three of four guessed right, then a miss
        req.token_ids.append(5)
    pol.shadow(req, [])
    assert req.spec_state.ema > pol.need(req, False)
    assert pol.wants_drafts(req, False)


def test_shadow_round_waits_for_enough_tokens():
    pol = SpecPolicy(SpeculativeConfig(method="ngram"), 0.0, free_drafts=True)
    req = _req()
    pol.wants_drafts(req, False)
    req.spec_state = SpecState(ema=1.0)
    pol.shadow(req, [7, 8])
    req.token_ids.append(7)
    pol.shadow(req, [9])  # one of two checked, all matching so far: still pending
    assert req.spec_state.ema == 1.0 and req.spec_state.shadow.draft == [7, 8]
    req.token_ids.append(8)
    pol.shadow(req, [9])  # both matched: a round that would have emitted 3
    assert req.spec_state.ema > 1.0 and req.spec_state.shadow.draft == [9]


def test_draft_model_backs_off_and_probes():
    pol = SpecPolicy(SpeculativeConfig(method="draft", draft_layers=2), 0.1, free_drafts=False)
    req = _req()
    assert pol.wants_drafts(req, False)
    pol.record(req, 1)
    pol.record(req, 1)
    assert not pol.wants_drafts(req, False)  # paused
    assert req.spec_state.pause_until == INITIAL_BACKOFF
    req.token_ids += [0] * INITIAL_BACKOFF
    assert pol.wants_drafts(req, False)  # the probe: one draft
    assert pol.num_drafts(req, 4) == 1
    pol.record(req, 1)
    assert not pol.wants_drafts(req, False)
    assert req.spec_state.backoff == 2 * INITIAL_BACKOFF  # failed again: twice the pause
    req.token_ids += [0] * 2 * INITIAL_BACKOFF
    assert pol.wants_drafts(req, False)
    pol.record(req, 2)  # the probe's draft was accepted: draft fully again
    assert pol.wants_drafts(req, False) and pol.num_drafts(req, 4) == 4


def test_new_requests_start_paused_when_the_draft_has_not_been_paying():
    pol = SpecPolicy(SpeculativeConfig(method="draft", draft_layers=2), 0.1, free_drafts=False)
    first = _req("a")
    pol.wants_drafts(first, False)
    for _ in range(30):
        pol.record(first, 1)
    assert not pol.wants_drafts(_req("b"), False)
    assert pol.wants_drafts(_req("c", SEEDED), False)  # seeded sampled: its own history only


def test_fit_step_keeps_batched_steps_small_unless_drafts_pay():
    pol = SpecPolicy(SpeculativeConfig(method="ngram"), 0.0, free_drafts=True, small_step_tokens=8)
    reqs = [_req(str(i)) for i in range(4)]
    for r, ema in zip(reqs, (2.0, 3.0, 2.5, 1.5)):
        r.spec_state = SpecState(ema=ema)
    # 4 rows + 16 drafts would leave the small-step path for rounds expected to emit ~9 tokens: cut to 4 drafts,
    # the best request first.
    assert pol.fit_step([(r, 4) for r in reqs], 4) == [0, 4, 0, 0]
    assert pol.fit_step([(r, 1) for r in reqs], 4) == [1, 1, 1, 1]  # fits: untouched
    for r in reqs:
        r.spec_state = SpecState(ema=4.5)  # rounds expected to emit 18 tokens >= 3 x 4: the large step pays
    assert pol.fit_step([(r, 4) for r in reqs], 4) == [4, 4, 4, 4]
    seeded = _req("s", SEEDED)
    seeded.spec_state = SpecState(ema=2.0)
    reqs[0].spec_state = SpecState(ema=2.0)
    assert pol.fit_step([(seeded, 4), (reqs[0], 4)], 8) == [4, 0]  # seeded sampled rows keep theirs


def test_a_draft_that_costs_more_than_a_round_can_emit_never_drafts():
    pol = SpecPolicy(SpeculativeConfig(method="draft", draft_model="x", num_speculative_tokens=4), 1.0,
                     free_drafts=False)
    assert not pol.wants_drafts(_req(), False)
    assert not pol.wants_drafts(_req("s", SEEDED), False)
    raw = SpecPolicy(SpeculativeConfig(method="draft", draft_model="x", adaptive=False), 1.0, free_drafts=False)
    assert raw.wants_drafts(_req(), False)  # adaptive=False: always (tests)


def test_in_a_full_batch_a_request_drafts_only_if_it_would_otherwise_outlast_the_others():
    pol = SpecPolicy(SpeculativeConfig(method="ngram"), 0.0, free_drafts=True)
    slow, a, b = _req("slow"), _req("a"), _req("b")
    a.token_ids += [0] * 10  # a has 10 tokens less of its budget left than the others
    # slow does not draft (rate 1), so the batch lasts as long as slow needs: a finishes first anyway and b ties
    # with slow, so neither's drafts would end the batch any sooner.
    assert pol.on_critical_path([a, b], [slow, a, b], {}) == [False, False]
    slow.token_ids += [0] * 20  # now b outlasts everyone (its drafts shorten the batch); a still finishes before b
    assert pol.on_critical_path([a, b], [slow, a, b], {}) == [False, True]
    slow.token_ids[-20:] = []
    # slow may draft too (it found no n-gram this step, but its rounds pay ~3.5 tokens): at that pace it needs
    # fewer steps than a and b without drafts, so they draft
    assert pol.on_critical_path([a, b], [slow, a, b], {id(slow): 3.5, id(a): 3.5, id(b): 3.5}) == [True, True]
    # seeded sampled requests decide alone (their output must not depend on the batch)
    seeded = _req("s", SEEDED)
    assert pol.on_critical_path([seeded], [_req("x"), seeded], {}) == [True]
    # a request alone is never held back; non-adaptive speculation drafts whatever the batch
    assert pol.on_critical_path([a], [a], {}) == [True]
    fixed = SpecPolicy(SpeculativeConfig(method="ngram", adaptive=False), 0.0, free_drafts=True)
    assert fixed.on_critical_path([a], [_req("y"), a], {}) == [True]
