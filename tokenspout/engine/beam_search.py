"""Beam search, as transformers does it (num_beams = width, do_sample=False, early_stopping=True).

The algorithm is a small state machine per prompt, driven by any engine that can score a batch of sequences: each
step every running beam is sent as one request for a single token with the top 2*width raw logprobs
(`max_tokens=1, logprobs=2*width`); `BeamSearch.step` merges them the way transformers' `_beam_search` does:

* the 2*width best continuations over all beams by cumulative logprob;
* those that end (EOS, or the length limit) and rank among the first `width` become finished hypotheses, scored
  cumulative / generated_length ** length_penalty, keeping the `width` best;
* the `width` best that do not end continue; the search stops once `width` hypotheses finished (early stopping),
  or nothing can continue.

KV is forked by the engine's automatic prefix caching (core/kv_cache_manager.py): each step's requests find the
full blocks of their prefix (prompt + the beam's earlier tokens) cached by the previous step's requests, and beams
that extend a common prefix share its blocks, so a step computes at most one block of tokens per beam instead of
the whole sequence (bench/beam.py measures it).  Full blocks are immutable, so the sharing is copy-on-write without
copies.  Without prefix caching every step recomputes every beam from scratch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenspout.checks import is_int


@dataclass(slots=True)
class BeamHypothesis:
    token_ids: list[int]
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty


@dataclass(slots=True)
class _Prompt:
    prompt_ids: list[int]
    running: list[tuple[list[int], float]]  # (generated tokens, cumulative logprob)
    finished: list[BeamHypothesis] = field(default_factory=list)
    done: bool = False


# score = logprob sum / length ** length_penalty: bounded so that the power stays a finite, nonzero float
MAX_LENGTH_PENALTY = 10.0
MAX_BEAM_WIDTH = 10


class BeamSearch:
    def __init__(self, prompts: list[list[int]], width: int, max_tokens: int, eos_token_id: int | None,
                 length_penalty: float = 1.0):
        if not is_int(width) or not 1 <= width <= MAX_BEAM_WIDTH:
            raise ValueError(f"n (the beam width) must be in [1, {MAX_BEAM_WIDTH}], got {width}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if not -MAX_LENGTH_PENALTY <= length_penalty <= MAX_LENGTH_PENALTY:  # (False for NaN)
            raise ValueError(f"length_penalty must be in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], "
                             f"got {length_penalty}")
        self.width = width
        self.max_tokens = max_tokens
        self.eos = eos_token_id
        self.length_penalty = length_penalty
        self.prompts = [_Prompt(list(p), [([], 0.0)]) for p in prompts]

    @property
    def done(self) -> bool:
        return all(p.done for p in self.prompts)

    def pending(self) -> list[list[int]]:
        """The sequences (prompt + beam) to score this step, in the order step() expects their logprobs."""
        return [p.prompt_ids + toks for p in self.prompts if not p.done for toks, _ in p.running]

    def step(self, top_logprobs: list[dict[int, float]]) -> None:
        """top_logprobs[i]: the next-token logprobs (at least the top 2*width) of pending()[i]."""
        it = iter(top_logprobs)
        for p in self.prompts:
            if not p.done:
                self._step_one(p, [next(it) for _ in p.running])

    def _step_one(self, p: _Prompt, lps: list[dict[int, float]]) -> None:
        k = 2 * self.width
        cands = []
        for b, ((toks, score), lp) in enumerate(zip(p.running, lps)):
            best = sorted(lp.items(), key=lambda kv: -kv[1])[:k]
            cands += [(score + v, b, t) for t, v in best]
        cands.sort(key=lambda c: -c[0])
        cands = cands[:k]
        running: list[tuple[list[int], float]] = []
        for score, b, t in cands:
            toks = p.running[b][0] + [t]
            if not (t == self.eos or len(toks) >= self.max_tokens) and len(running) < self.width:
                running.append((toks, score))
        # Finished hypotheses: the step's top-`width` candidates that end, merged with earlier ones (best `width`).
        if len(p.finished) < self.width:
            new = [BeamHypothesis(p.running[b][0] + [t], score,
                                  score / (len(p.running[b][0]) + 1) ** self.length_penalty)
                   for rank, (score, b, t) in enumerate(cands)
                   if rank < self.width and (t == self.eos or len(p.running[b][0]) + 1 >= self.max_tokens)]
            p.finished = sorted(p.finished + new, key=lambda h: -h.score)[: self.width]
        p.running = running
        p.done = len(p.finished) >= self.width or not running

    def results(self) -> list[list[BeamHypothesis]]:
        """Per prompt, the finished hypotheses best first (running beams count if none finished)."""
        out = []
        for p in self.prompts:
            hyps = p.finished or [BeamHypothesis(t, s, s / max(1, len(t)) ** self.length_penalty)
                                  for t, s in p.running]
            out.append(sorted(hyps, key=lambda h: -h.score))
        return out


def to_request_outputs(search: BeamSearch, request_ids: list[str], prompts: list[list[int]], n: int,
                       decode) -> list:
    """The n best hypotheses of each prompt as RequestOutputs (finish_reason "stop" when a beam ended on EOS)."""
    from tokenspout.outputs import CompletionOutput, RequestOutput

    outs = []
    for rid, prompt, hyps in zip(request_ids, prompts, search.results()):
        choices = [CompletionOutput(i, decode(h.token_ids), h.token_ids, h.cumulative_logprob,
                                    finish_reason="stop" if h.token_ids and h.token_ids[-1] == search.eos
                                    else "length")
                   for i, h in enumerate(hyps[:n])]
        outs.append(RequestOutput(rid, None, prompt, choices, finished=True))
    return outs
