"""SamplingState: the sampling side of the persistent rows (each row's request knobs, for the request's whole
life) and the per-step SamplingMetadata built from it.

Knobs that never change for a request sit in two host tables [max_num_reqs, F] written once in `add_request`; a
step's [num_rows] tensors are one index_select of each and one copy to the device.  Host-side per-slot records
(_Slot) hold what the step plan needs without reading tensors back (row classes, top_k, which rows ask for
logprobs, bans due this step), so building the metadata never synchronises with the device.  Token counts for
the penalties are kept incrementally (sample/ops/token_counts.py).  InputBatch (input_batch.py) owns the one
instance of the model runner; `build_metadata` makes a throwaway one for tests and benchmarks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import cast

import torch

from tokenspout.sample.metadata import SamplingMetadata
from tokenspout.sample.ops.mirostat import MirostatBatch, MirostatState
from tokenspout.sample.ops.noise import seed_key
from tokenspout.sample.ops.penalties import PenaltyBatch
from tokenspout.sample.ops.rows_cpu import KERNEL_MAX_TOP_K
from tokenspout.sample.ops.repeats import DryState, NgramBans
from tokenspout.sample.ops.thinking import ThinkingBudget
from tokenspout.sample.ops.token_counts import SeenTokens
from tokenspout.sample.ops.warpers import WarpBatch
from tokenspout.sampling_params import LOGIT_BIAS_CLAMP, SamplingParams
from tokenspout.tensors import long_tensor

_F = ("temperature", "top_p", "min_p", "repetition", "presence", "frequency")  # columns of the float table
_I = ("top_k", "seed", "seed_key")  # columns of the int table

Allowed = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # SamplingMetadata.allowed
Banned = tuple[torch.Tensor, torch.Tensor]  # SamplingMetadata.banned
Bias = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # SamplingMetadata.bias


@dataclass(slots=True)
class _Slot:
    """Host-side facts about a slot's request, precomputed once so that building the metadata is a cheap loop."""

    greedy: bool
    truncated: bool  # random, with top-k, top-p or min_p
    top_k: int
    top_p_on: bool
    min_p_on: bool
    penalties: bool
    repetition: bool
    additive: bool  # presence or frequency penalty
    stop_ids: list[int]
    min_tokens: int
    bad_single: list[int]
    bad_multi: list[list[int]]
    allowed: torch.Tensor | None
    bias_ids: torch.Tensor | None
    bias_vals: torch.Tensor | None
    num_logprobs: int
    processed: bool
    position: int
    output: list[int] | None  # only kept for multi-token bad words
    warp: tuple[float, ...] | None  # a random row's warper knobs (WarpBatch.build's order), None if it uses none
    ngram: NgramBans | None  # no_repeat_ngram_size's table over prompt + output
    dry: DryState | None  # DRY's match lengths over prompt + output
    mirostat: MirostatState | None  # a random mirostat row's request state (mu), shared with the request
    mirostat_knobs: tuple[int, float, float]  # (mode, tau, eta)
    thinking: ThinkingBudget | None  # thinking_token_budget's state over the output (rebuilt after preemption)

    def banned_now(self) -> list[int]:
        """Ids this row may not sample at its current position: single-token bad words, the last token of each
        multi-token bad word the output ends with the rest of, and the stop ids while min_tokens is not reached."""
        banned = list(self.bad_single)
        if self.bad_multi:
            out = self.output or []
            for word in self.bad_multi:
                n = len(word) - 1
                if len(out) >= n and out[-n:] == word[:-1]:
                    banned.append(word[-1])
        if self.position < self.min_tokens:
            banned += self.stop_ids
        if self.ngram is not None:
            banned += self.ngram.banned()
        return banned

    def follows_tokens(self) -> bool:
        """Whether this row's metadata changes with the tokens it emits, beyond its position: penalties count
        them, a multi-token bad word is banned after its prefix, stop ids are banned until min_tokens.  Narrower
        than SamplingParams.depends_on_output on purpose: single-token bad words and a min_tokens without stop
        ids to ban give fixed metadata, which the last-metadata cache may keep."""
        return (self.penalties or bool(self.bad_multi) or (self.position < self.min_tokens and bool(self.stop_ids))
                or self.ngram is not None or self.dry is not None or self.mirostat is not None
                or self.thinking is not None)


_F32_TINY = float(torch.finfo(torch.float32).tiny)


def _new_slot(params: SamplingParams, top_k: int, top_p: float, num_logprobs: int, prompt_token_ids: list[int],
              output_token_ids: list[int], device: torch.device, mirostat: MirostatState | None) -> _Slot:
    greedy = params.is_greedy
    bad = params.bad_words_token_ids or []
    bias_ids = bias_vals = allowed = None
    if params.logit_bias:
        bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.int64, device=device)
        vals = [max(-LOGIT_BIAS_CLAMP, min(LOGIT_BIAS_CLAMP, v)) for v in params.logit_bias.values()]
        bias_vals = torch.tensor(vals, dtype=torch.float32, device=device)
    if params.allowed_token_ids is not None:
        allowed = torch.tensor(sorted(set(params.allowed_token_ids)), dtype=torch.int64, device=device)
    bad_multi = [list(w) for w in bad if len(w) > 1]
    return _Slot(
        greedy=greedy, truncated=not greedy and (top_k > 0 or top_p < 1.0 or params.min_p > 0.0), top_k=top_k,
        top_p_on=top_p < 1.0, min_p_on=params.min_p > 0.0, penalties=params.has_penalties,
        repetition=params.repetition_penalty != 1.0,
        additive=params.presence_penalty != 0.0 or params.frequency_penalty != 0.0,
        stop_ids=sorted(params.all_stop_token_ids), min_tokens=params.min_tokens,
        bad_single=sorted({w[0] for w in bad if len(w) == 1}), bad_multi=bad_multi, allowed=allowed,
        bias_ids=bias_ids, bias_vals=bias_vals, num_logprobs=num_logprobs,
        processed=params.logprobs_mode == "processed_logprobs", position=len(output_token_ids),
        output=list(output_token_ids) if bad_multi else None,
        warp=None if greedy or not params.uses_warpers else (
            params.typical_p, params.epsilon_cutoff, params.eta_cutoff, params.top_n_sigma, params.xtc_probability,
            params.xtc_threshold, params.dynatemp_range, params.dynatemp_exponent),
        ngram=NgramBans(params.no_repeat_ngram_size, [*prompt_token_ids, *output_token_ids])
        if params.no_repeat_ngram_size > 0 else None,
        dry=DryState(params.dry_multiplier, params.dry_base, params.dry_allowed_length, params.dry_penalty_last_n,
                     params.dry_sequence_breaker_ids or [], [*prompt_token_ids, *output_token_ids])
        if params.uses_dry else None,
        mirostat=None if greedy or not params.mirostat else (
            mirostat or MirostatState.initial(params.mirostat, params.mirostat_tau)),
        mirostat_knobs=(params.mirostat, params.mirostat_tau, params.mirostat_eta),
        thinking=ThinkingBudget(params.thinking_token_budget, params.reasoning_start_token_ids,
                                params.reasoning_end_token_ids, output_token_ids)
        if params.thinking_token_budget is not None and params.reasoning_end_token_ids else None,
    )


@dataclass(slots=True)
class _RowClasses:
    """How each row of a step is sampled (SamplingMetadata's row lists; rows ascending)."""

    greedy: list[int] = field(default_factory=list)
    truncated: list[int] = field(default_factory=list)
    truncated_top_k: list[int] = field(default_factory=list)
    plain: list[int] = field(default_factory=list)
    kernel: list[int] = field(default_factory=list)
    warp_kernel: list[int] = field(default_factory=list)
    any_top_p: bool = False
    any_min_p: bool = False


def _row_classes(infos: list[_Slot]) -> _RowClasses:
    c = _RowClasses()
    for row, info in enumerate(infos):
        if info.greedy:
            c.greedy.append(row)
        elif info.truncated:
            c.truncated.append(row)
            c.truncated_top_k.append(info.top_k)
            c.any_top_p |= info.top_p_on
            c.any_min_p |= info.min_p_on
        else:
            c.plain.append(row)
        # The kernel draws a row without keeping its distribution, so not one that wants processed logprobs, and it
        # knows none of the warpers (ops/warpers.py): their rows take the torch path.
        if (not info.greedy and info.top_k <= KERNEL_MAX_TOP_K and not (info.num_logprobs >= 0 and info.processed)
                and info.mirostat is None):
            if info.warp is None:
                c.kernel.append(row)
            elif info.top_k > 0 or info.warp[0] >= 1.0:  # whole rows only without typical_p (it orders them)
                c.warp_kernel.append(row)
    return c


def _banned(infos: list[_Slot], device: torch.device) -> Banned | None:
    """(row, id) pairs forced to -inf this step: bad words and min_tokens alike, so one scatter."""
    rows: list[int] = []
    ids: list[int] = []
    for row, info in enumerate(infos):
        now = info.banned_now()
        rows += [row] * len(now)
        ids += now
    return (long_tensor(rows, device), long_tensor(ids, device)) if rows else None


def _bias(infos: list[_Slot]) -> Bias | None:
    """(row, id, clamped bias) of every logit_bias entry; the slots' tensors are already on the device."""
    rows, ids, vals = [], [], []
    for row, info in enumerate(infos):
        if info.bias_ids is not None and info.bias_vals is not None:
            rows.append(torch.full_like(info.bias_ids, row))
            ids.append(info.bias_ids)
            vals.append(info.bias_vals)
    return (torch.cat(rows), torch.cat(ids), torch.cat(vals)) if rows else None


def _allowed(infos: list[_Slot], device: torch.device) -> Allowed | None:
    """(rows with allowed_token_ids, index into those rows, id) of every allowed pair."""
    rows: list[int] = []
    local, ids = [], []
    for row, info in enumerate(infos):
        forced = info.thinking.forced_now() if info.thinking is not None else None
        allowed = info.allowed if forced is None else torch.tensor([forced], dtype=torch.int64, device=device)
        if allowed is not None:  # a forced end-of-reasoning token is the only allowed one
            local.append(torch.full_like(allowed, len(rows)))
            rows.append(row)
            ids.append(allowed)
    return (long_tensor(rows, device), torch.cat(local), torch.cat(ids)) if rows else None


def _logprob_rows(infos: list[_Slot], device: torch.device) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(largest num_logprobs asked, -1 if none; rows asking for raw logprobs; rows asking for processed ones)."""
    raw: list[int] = []
    processed: list[int] = []
    max_lp = -1
    for row, info in enumerate(infos):
        if info.num_logprobs >= 0:
            (processed if info.processed else raw).append(row)
            max_lp = max(max_lp, info.num_logprobs)
    return max_lp, long_tensor(raw, device), long_tensor(processed, device)


def _dry(infos: list[_Slot], device: torch.device) -> Bias | None:
    """(row, id, -penalty) of DRY's penalties this step, added like logit_bias."""
    rows: list[int] = []
    ids: list[int] = []
    vals: list[float] = []
    for row, info in enumerate(infos):
        if info.dry is not None:
            i, v = info.dry.penalties()
            rows += [row] * len(i)
            ids += i
            vals += [-x for x in v]
    if not rows:
        return None
    return long_tensor(rows, device), long_tensor(ids, device), torch.tensor(vals, dtype=torch.float32, device=device)


def _mirostat(infos: list[_Slot], device: torch.device) -> MirostatBatch | None:
    rows = [r for r, info in enumerate(infos) if info.mirostat is not None]
    if not rows:
        return None
    states = [cast("MirostatState", infos[r].mirostat) for r in rows]
    knobs = [infos[r].mirostat_knobs for r in rows]
    return MirostatBatch(rows, long_tensor([k[0] for k in knobs], device),
                         torch.tensor([k[1] for k in knobs], dtype=torch.float32, device=device),
                         torch.tensor([k[2] for k in knobs], dtype=torch.float32, device=device),
                         torch.tensor([s.mu for s in states], dtype=torch.float32, device=device), states,
                         [r for r in rows if not (infos[r].num_logprobs >= 0 and infos[r].processed)])


def _warp(infos: list[_Slot], device: torch.device) -> WarpBatch | None:
    rows = [r for r, info in enumerate(infos) if info.warp is not None]
    if not rows:
        return None
    return WarpBatch.build(rows, [cast("tuple[float, ...]", infos[r].warp) for r in rows], device)


class SamplingState:
    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = torch.device(device)

        # Per-slot knobs live in host tables written through numpy views (a torch element write costs
        # microseconds; add_request writes nine of them); metadata() gathers the step's rows in one
        # index_select per table and moves them to the device.
        self._f = torch.zeros(max_num_reqs, len(_F), dtype=torch.float32)
        self._i = torch.zeros(max_num_reqs, len(_I), dtype=torch.int64)
        self._fv = self._f.numpy()
        self._iv = self._i.numpy()
        self.seen = SeenTokens(max_num_reqs, self.device)
        self._slots: list[_Slot | None] = [None] * max_num_reqs
        # The last metadata built, for the next step over the same requests: decode steps usually are, and then
        # everything but the positions is unchanged unless a row's bans or penalties follow its tokens.  Keyed on
        # the slots and a count of add/remove calls (a slot reused by another request changes the key).
        self._generation = 0
        self._last: tuple[tuple[int, ...], SamplingMetadata] | None = None

    def add_request(
        self, slot: int, params: SamplingParams, prompt_token_ids: list[int], output_token_ids: list[int],
        seed: int, mirostat: MirostatState | None = None,
    ) -> None:
        """`mirostat`: the request's state object (core.request.Request keeps it across preemption); a fresh one
        (mu = 2 * tau) when None."""
        greedy = params.is_greedy
        top_k = params.top_k if 0 < params.top_k < self.vocab_size else 0
        # at least float32's smallest normal: 1e-300 became 0.0 in the float32 table, which kept no token at all
        # (the row then drew token 0 every step); any p > 0 keeps the top token, as this does
        top_p = min(1.0, max(params.top_p, _F32_TINY))
        n_lp = -1 if params.logprobs is None else params.logprobs
        self._fv[slot] = (1.0 if greedy else params.temperature, top_p, params.min_p, params.repetition_penalty,
                          params.presence_penalty, params.frequency_penalty)
        seed &= (1 << 63) - 1
        self._iv[slot] = (top_k, seed, seed_key(seed))
        self._slots[slot] = _new_slot(params, top_k, top_p, n_lp, prompt_token_ids, output_token_ids, self.device,
                                      mirostat)
        if params.has_penalties:
            self.seen.reset(slot, prompt_token_ids, output_token_ids)
        else:
            self.seen.clear(slot)
        self._generation += 1

    def remove_request(self, slot: int) -> None:
        self._slots[slot] = None
        self.seen.clear(slot)
        self._generation += 1

    def append_tokens(self, slots: list[int], token_ids: list[list[int]]) -> None:
        for slot, toks in zip(slots, token_ids):
            info = self._slots[slot]
            assert info is not None, f"slot {slot} has no request"
            info.position += len(toks)
            if info.output is not None:
                info.output.extend(toks)
            if info.ngram is not None:
                info.ngram.extend(toks)
            if info.dry is not None:
                info.dry.extend(toks)
            if info.thinking is not None:
                info.thinking.extend(toks)
        self.seen.append(slots, token_ids)

    def output_counts(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense (output counts [V], seen-in-prompt-or-output mask [V]) of a penalised slot (tests)."""
        return self.seen.dense_counts(slot, self.vocab_size)

    def metadata(self, slots: list[int]) -> SamplingMetadata:
        """The step's metadata (a fresh object: callers set fields of their own, e.g. grammar_bitmask)."""
        key = (self._generation, *slots)
        if self._last is not None and self._last[0] == key:
            # The same requests as when it was built (any add or remove changes the key): every slot holds one.
            infos = cast("list[_Slot]", [self._slots[s] for s in slots])
            return dataclasses.replace(self._last[1], positions=long_tensor([i.position for i in infos], self.device))
        md, follows_tokens = self._build(slots)
        self._last = None if follows_tokens else (key, md)
        return dataclasses.replace(md)

    def _infos(self, slots: list[int]) -> list[_Slot]:
        infos = [self._slots[s] for s in slots]
        assert all(i is not None for i in infos), "metadata() for a slot with no request"
        return cast("list[_Slot]", infos)

    def _build(self, slots: list[int]) -> tuple[SamplingMetadata, bool]:
        """(the metadata, whether some row's metadata follows its tokens: then it is rebuilt each step)."""
        dev = self.device
        infos = self._infos(slots)
        cpu_idx = long_tensor(slots)
        floats = self._f.index_select(0, cpu_idx).t().to(dev).contiguous()
        ints = self._i.index_select(0, cpu_idx).t().to(dev).contiguous()
        temperature, top_p, min_p, rep, pres, freq = floats.unbind(0)
        top_k, seeds, seed_keys = ints.unbind(0)
        classes = _row_classes(infos)
        max_lp, raw_rows, processed_rows = _logprob_rows(infos, dev)
        md = SamplingMetadata(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seeds=seeds,
            seed_keys=seed_keys,
            positions=long_tensor([info.position for info in infos], dev),
            greedy_rows=classes.greedy,
            truncated_rows=classes.truncated,
            truncated_top_k=classes.truncated_top_k,
            plain_rows=classes.plain,
            kernel_rows=classes.kernel,
            any_top_p=classes.any_top_p,
            any_min_p=classes.any_min_p,
            allowed=_allowed(infos, dev),
            banned=_banned(infos, dev),
            bias=_bias(infos),
            penalties=self._penalties(slots, infos, rep, pres, freq),
            max_num_logprobs=max_lp,
            raw_logprob_rows=raw_rows,
            processed_logprob_rows=processed_rows,
            warp=_warp(infos, dev),
            dry=_dry(infos, dev),
            mirostat=_mirostat(infos, dev),
            warp_kernel_rows=classes.warp_kernel,
        )
        return md, any(info.follows_tokens() for info in infos)

    def _penalties(self, slots: list[int], infos: list[_Slot], rep: torch.Tensor, pres: torch.Tensor,
                   freq: torch.Tensor) -> PenaltyBatch | None:
        """The penalised rows' seen tokens and knobs (rep, pres, freq: every row's, [R])."""
        rows = [r for r, info in enumerate(infos) if info.penalties]
        if not rows:
            return None
        ids, counts, seen = self.seen.gather([slots[r] for r in rows])
        idx = long_tensor(rows, self.device)
        return PenaltyBatch(idx, ids, counts, seen, rep.index_select(0, idx), pres.index_select(0, idx),
                            freq.index_select(0, idx), any(infos[r].repetition for r in rows),
                            any(infos[r].additive for r in rows))


def build_metadata(
    params: list[SamplingParams],
    vocab_size: int,
    *,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    seeds: list[int] | None = None,
    device: torch.device | str = "cpu",
) -> SamplingMetadata:
    """One-off metadata for a list of requests, row i = params[i] (tests, benchmarks).  Unseeded rows get
    their request's seed, or i."""
    n = len(params)
    state = SamplingState(n, vocab_size, torch.device(device))
    for i, p in enumerate(params):
        seed = seeds[i] if seeds is not None else (p.seed if p.seed is not None else i)
        state.add_request(i, p, prompts[i] if prompts else [], outputs[i] if outputs else [], seed)
    return state.metadata(list(range(n)))
