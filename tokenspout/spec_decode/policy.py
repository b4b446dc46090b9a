"""When a request drafts: speculation is turned on and off per request by whether its rounds pay.

A verification round of d drafts costs more than a plain step (on this CPU a k=4 verification step costs about two
plain steps at batch 1 -- small-M GEMMs are far less efficient than the M=1 GEMV -- and relatively more in a batch,
where the step is no longer bound by reading the weights), plus, for a draft model, d draft forwards of
`draft_cost` plain steps each.  It pays when it emits more tokens than it costs steps.  So each request keeps an
exponential moving average of the tokens its rounds emit (accepted + 1) and drafts only while that average clears
the bar `need`:

    need = (min_mean_emitted, or min_mean_emitted_batched when other requests share the batch) + d * draft_cost

Evidence while not drafting:
- n-gram drafts are free to make, so a request that does not draft still proposes, and the proposal is checked
  against the tokens that follow (a *shadow round*).  The accepted length of a real round is the common prefix of
  the draft and the tokens the target emits (greedy: by definition; sampled: accept x with probability p(x) is
  exactly the chance that the sampled token equals x, position by position), so a shadow round is a free,
  unbiased sample of what a real round would have given.  Requests start not drafting and draft as soon as that
  pays.
- Draft-model drafts cost forwards, so a request whose average falls below the bar pauses for 16, 32, ... 256
  output tokens (doubling each time a probe round fails again; text often turns repetitive later, so never for
  good).  A probe is one round of a single draft (a draft forward and a two-token verification, about a third of
  a full round here): its verdict alone decides -- accepted: draft fully again; rejected: pause twice as long.  A new request starts paused if the proposer has not been paying
  for the requests before it (engine-wide average), so a useless draft costs one round per request, not four.

Seeded sampled requests must give the same text alone or in any batch, and their output depends on which rounds
drafted: their decisions use only their own history and the batch-1 bar (never the batch size or other requests).
Greedy output never depends on the decisions, unseeded output promises nothing, so those use the batch bar.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tokenspout.config import SpeculativeConfig
from tokenspout.core.request import Request

logger = logging.getLogger(__name__)

EMA_WEIGHT = 0.35  # weight of the newest round: ~3 rounds of memory, so a request reacts within a few rounds
INITIAL_BACKOFF = 16
MAX_BACKOFF = 256


@dataclass(slots=True)
class ShadowRound:
    start: int  # num_tokens when proposed: the draft guesses token_ids[start : start + len(draft)]
    draft: list[int]


@dataclass(slots=True)
class SpecState:
    """A request's speculation history, owned by the policy (Request.spec_state, made by SpecPolicy.start)."""

    ema: float = 0.0  # the average tokens its rounds emit (set by SpecPolicy.start, its first decision)
    pause_until: int = 0  # draft model: no drafts until the output holds this many tokens
    backoff: int = 0  # the length of the last pause
    probe: bool = False  # the round after a pause is a probe
    shadow: ShadowRound | None = None  # the pending n-gram shadow round


class SpecPolicy:
    def __init__(self, spec: SpeculativeConfig, draft_cost: float, free_drafts: bool, small_step_tokens: int = 0):
        self.k = spec.num_speculative_tokens
        self.spec = spec
        self.draft_cost = draft_cost  # one draft forward in plain target steps (0 for n-gram)
        self.free_drafts = free_drafts  # n-gram: proposals cost nothing, so shadow rounds replace pauses
        self.global_ema = float(self.k + 1)  # engine-wide emitted per round (real rounds), optimistic at start
        # Steps of at most this many tokens run through the C decode kernels, which read every weight once for
        # the whole step; a larger step falls back to torch GEMMs and costs spec.large_step_cost plain steps.
        self.small_step_tokens = small_step_tokens
        # A round emits at most k + 1 tokens: a draft that costs more than that can never pay, so it never drafts.
        self.hopeless = spec.min_mean_emitted + self.k * draft_cost >= self.k + 1
        if self.hopeless and spec.adaptive:
            logger.warning("speculation is off: %d draft forwards cost %.1f plain steps, more than a round can "
                           "emit (%d tokens); use a smaller draft", self.k, self.k * draft_cost, self.k + 1)

    def fit_step(self, cands: list[tuple[Request, int]], num_rows: int) -> list[int]:
        """How many drafts each request that wants drafts (request, drafts it may take) gets next step, given
        num_rows requests in the batch.  Drafts that would push the step past the small-step path are kept only
        when the rounds are expected to emit enough to pay for the large step; else they are cut, best requests
        (highest average) first served.  Seeded sampled requests keep theirs (batch-invariant decisions)."""
        counts = [n for _, n in cands]
        small = self.small_step_tokens
        if not small or not self.spec.adaptive or num_rows + sum(counts) <= small:
            return counts
        expected = num_rows - len(cands) + sum(min(self.state(r).ema, n + 1) for r, n in cands)
        if expected >= self.spec.large_step_cost * num_rows:
            return counts
        fixed = [i for i, (r, _) in enumerate(cands) if _independent(r)]
        room = small - num_rows - sum(counts[i] for i in fixed)
        for i in sorted(set(range(len(cands))) - set(fixed), key=lambda i: -self.state(cands[i][0]).ema):
            counts[i] = max(0, min(counts[i], room))
            room -= counts[i]
        return counts

    def on_critical_path(self, drafting: list[Request], running: list[Request], rates: dict[int, float]) -> list[bool]:
        """Which of the requests with drafts for this step may use them, in a batch with no request waiting for a
        slot.  rates: tokens per step expected of each running request (id -> its average per round if the policy
        lets it draft, whether or not it found drafts this step; absent: 1).

        Such a batch lasts as many steps as its slowest member needs, and a step costs mostly the weight reads that
        every row shares (a few extra rows add little to the shared cost but something to every step): drafts for
        a request that will finish before the others anyway save no step, they only make every step dearer (free
        chat at batch 8: 0.92x with drafts for the requests whose n-grams matched).  So a request drafts only if,
        without drafts, it would outlast every other request at that one's expected pace.  With requests waiting,
        finishing early frees a slot for one of them, and the ordinary rule decides.  Seeded sampled requests keep
        their batch-invariant decisions."""
        if not self.spec.adaptive:
            return [True] * len(drafting)
        # the two slowest requests' remaining steps: a request is compared with the slowest of the others
        steps = sorted(((r.max_len - r.num_tokens) / rates.get(id(r), 1.0), id(r)) for r in running)[-2:]
        keep = []
        for r in drafting:
            others = [s for s, rid in steps if rid != id(r)]
            keep.append(_independent(r) or r.max_len - r.num_tokens > (others[-1] if others else 0.0))
        return keep

    def need(self, req: Request, batched: bool) -> float:
        base = self.spec.min_mean_emitted
        if batched and not _independent(req):
            base = self.spec.min_mean_emitted_batched
        return base + self.k * self.draft_cost

    def start(self, req: Request, batched: bool) -> None:
        """A request's first decision.  n-gram: just below the bar, so its first shadow round decides -- one
        that would have emitted about need + 1 tokens or more turns drafting on (with k = 4: 4 or 5 tokens alone,
        5 in a batch) -- and a request whose n-grams never match pays no failed real round (free chat at batch 8:
        ~15 of them, each step ~25% dearer).  Draft model: optimistic (it
        drafts: there is no free evidence), unless the proposer has not been paying lately (then it starts
        paused; seeded sampled requests ignore other requests)."""
        need = self.need(req, batched)
        req.spec_state = SpecState(ema=need - 0.5 if self.free_drafts else need + 0.5)
        if not self.free_drafts and not _independent(req) and self.global_ema < need:
            self._pause(req, 2 * INITIAL_BACKOFF)

    def wants_drafts(self, req: Request, batched: bool) -> bool:
        """Whether the request drafts this step (call for decoding, speculation-eligible requests)."""
        if req.spec_state is None:
            self.start(req, batched)
        st = self.state(req)
        if not self.spec.adaptive:
            return True
        if self.hopeless:
            return False
        if self.free_drafts:
            return st.ema >= self.need(req, batched)
        if req.num_output_tokens < st.pause_until:
            return False
        if st.probe:
            return True
        if st.ema < self.need(req, batched):
            self._pause(req, min(2 * st.backoff or INITIAL_BACKOFF, MAX_BACKOFF))
            return False
        return True

    def num_drafts(self, req: Request, room: int) -> int:
        """Drafts for a request that wants them: one on a probe (cheap evidence), else all the room."""
        return min(room, 1) if self.state(req).probe and self.spec.adaptive else room

    def record(self, req: Request, emitted: int) -> None:
        """A real verification round of the request emitted `emitted` tokens (accepted + 1)."""
        st = self.state(req)
        if st.probe:  # the probe's verdict alone: its one draft accepted or not
            st.ema = float(self.k + 1) if emitted > 1 else 1.0
            st.probe = False
        else:
            st.ema += EMA_WEIGHT * (emitted - st.ema)
        self.global_ema += 0.1 * (emitted - self.global_ema)

    # ---- n-gram shadow rounds ---------------------------------------------------------------------------
    def shadow(self, req: Request, draft: list[int]) -> None:
        """Settles the request's pending shadow round against the tokens emitted since, and starts a new one
        with `draft` when none is pending (one at a time: rounds do not overlap, like real ones)."""
        st = self.state(req)
        sh = st.shadow
        if sh is not None:
            got = req.token_ids[sh.start : sh.start + len(sh.draft)]
            n = 0
            while n < len(got) and got[n] == sh.draft[n]:
                n += 1
            if n == len(got) and len(got) < len(sh.draft):
                return  # still matching: wait for more tokens
            st.ema += EMA_WEIGHT * (n + 1 - st.ema)
            st.shadow = sh = None
        if draft:
            st.shadow = ShadowRound(req.num_tokens, draft)

    def _pause(self, req: Request, backoff: int) -> None:
        st = self.state(req)
        st.backoff = backoff
        st.pause_until = req.num_output_tokens + backoff
        st.probe = True

    def state(self, req: Request) -> SpecState:
        """The request's speculation state (its first decision, wants_drafts, makes it)."""
        if req.spec_state is None:
            raise RuntimeError(f"{req.request_id}: no speculation decision yet")
        return req.spec_state


def _independent(req: Request) -> bool:
    """Seeded sampled requests: their drafting decisions may depend only on their own history."""
    return not req.params.is_greedy and req.params.seed is not None


def draft_cost(draft_params: int, target_params: int) -> float:
    """One draft forward in plain target steps: decode on a CPU is bound by reading the weights, so the ratio of
    the weights each forward reads (layers + LM head)."""
    return draft_params / target_params
