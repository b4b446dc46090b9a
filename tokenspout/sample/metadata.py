"""Sampling state per slot (persistent for the whole run) and the per-step SamplingMetadata.

SamplingState lives in the model runner.  Knobs that never change for a request sit in two host tables
[max_num_reqs, F] written once in `add_request`; a step's [num_rows] tensors are one index_select of each
and one copy to the device.  Host-side per-slot records hold what the step plan needs without reading
tensors back (row classes, top_k, which rows ask for logprobs, bans due this step), so building the
metadata never synchronises with the device.  Token counts for the penalties are kept incrementally
(ops/token_counts.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from tokenspout.sample.ops.noise import seed_key
from tokenspout.sample.ops.penalties import PenaltyBatch
from tokenspout.sample.ops.token_counts import SeenTokens
from tokenspout.sampling_params import LOGIT_BIAS_CLAMP, SamplingParams
from tokenspout.tensors import long_tensor

KERNEL_MAX_TOP_K = 1024  # largest top_k the CPU kernel takes (ops/rows_cpu.py): its heap and sort grow with k

_F = ("temperature", "top_p", "min_p", "repetition", "presence", "frequency")  # columns of the float table
_I = ("top_k", "seed", "num_logprobs", "greedy", "seed_key")  # columns of the int table


@dataclass(slots=True)
class SamplingMetadata:
    """Everything the sampler needs for one step; row i belongs to slots[i]."""

    # Per-row knobs, [R].
    temperature: torch.Tensor  # float32; 1.0 on greedy rows (the zero guard: greedy rows never divide by ~0)
    is_greedy: torch.Tensor  # bool
    top_k: torch.Tensor  # int64; 0 = off (values >= vocab are normalised to 0)
    top_p: torch.Tensor  # float32; 1.0 = off
    min_p: torch.Tensor  # float32; 0.0 = off
    seeds: torch.Tensor  # int64, the effective 63-bit seed of each row's request
    seed_keys: torch.Tensor  # int64, noise.seed_key(seed), hashed once per request (noise.keys_from_seed_keys)
    positions: torch.Tensor  # int64, output tokens generated so far (the draw's counter)
    num_logprobs: torch.Tensor  # int64; -1 = no logprobs
    # Row classes (index tensors into the batch, ascending), decided on the host.
    greedy_rows: torch.Tensor
    truncated_rows: torch.Tensor  # random rows with top-k, top-p or min_p
    plain_rows: torch.Tensor  # random rows with none of them (temperature only): drawn densely
    all_greedy: bool
    any_greedy: bool
    max_top_k: int  # largest top_k over the truncated rows (0 if none)
    truncated_top_k: list[int]  # host copy of top_k of the truncated rows (plans candidate-set sizes)
    any_top_p: bool  # some truncated row has top_p < 1
    any_min_p: bool  # some truncated row has min_p > 0
    truncated_list: list[int]  # host copies of truncated_rows and plain_rows
    plain_list: list[int]
    kernel_rows: list[int]  # random rows with top_k <= KERNEL_MAX_TOP_K (0 = off) and no processed logprobs:
    # the CPU kernel (ops/rows_cpu.py) may draw them (they need no kept distribution afterwards)
    # Sparse edits; None when no row has any.
    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, local row, id) allowed pairs
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (row, id) pairs forced to -inf: bad words, min_tokens
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (row, id, clamped bias)
    penalties: PenaltyBatch | None
    # Logprobs.
    max_num_logprobs: int  # -1 if no row asks
    raw_logprob_rows: torch.Tensor  # rows asking for raw logprobs (log_softmax before any processing)
    processed_logprob_rows: torch.Tensor  # rows asking for logprobs of the processed distribution
    grammar_bitmask: torch.Tensor | None = None  # [R, ceil(V/32)] int32, bit set = allowed; filled later

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @property
    def no_penalties(self) -> bool:
        return self.penalties is None


@dataclass(slots=True)
class _Slot:
    """Host-side facts about a slot's request, precomputed once so `metadata` is a cheap loop."""

    greedy: bool
    truncated: bool
    top_k: int
    top_p_on: bool
    min_p_on: bool
    penalties: bool
    repetition: bool
    additive: bool
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


class SamplingState:
    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = torch.device(device)

        # Per-slot knobs live in host tables written through numpy views (a torch element write costs
        # microseconds; add_request writes ten of them); metadata() gathers the step's rows in one
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
        self._last: tuple[tuple, SamplingMetadata] | None = None

    def add_request(
        self, slot: int, params: SamplingParams, prompt_token_ids: list[int], output_token_ids: list[int],
        seed: int,
    ) -> None:
        greedy = params.is_greedy
        top_k = params.top_k if 0 < params.top_k < self.vocab_size else 0
        top_p = min(1.0, params.top_p)
        truncated = not greedy and (top_k > 0 or top_p < 1.0 or params.min_p > 0.0)
        rep_on = params.repetition_penalty != 1.0
        add_on = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        n_lp = -1 if params.logprobs is None else params.logprobs
        self._fv[slot] = (1.0 if greedy else params.temperature, top_p, params.min_p, params.repetition_penalty,
                          params.presence_penalty, params.frequency_penalty)
        seed &= (1 << 63) - 1
        self._iv[slot] = (top_k, seed, n_lp, greedy, seed_key(seed))
        bad = params.bad_words_token_ids or []
        bias_ids = bias_vals = allowed = None
        if params.logit_bias:
            bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.int64, device=self.device)
            vals = [max(-LOGIT_BIAS_CLAMP, min(LOGIT_BIAS_CLAMP, v)) for v in params.logit_bias.values()]
            bias_vals = torch.tensor(vals, dtype=torch.float32, device=self.device)
        if params.allowed_token_ids is not None:
            allowed = torch.tensor(sorted(set(params.allowed_token_ids)), dtype=torch.int64, device=self.device)
        bad_multi = [list(w) for w in bad if len(w) > 1]
        self._slots[slot] = _Slot(
            greedy=greedy, truncated=truncated, top_k=top_k, top_p_on=top_p < 1.0, min_p_on=params.min_p > 0.0,
            penalties=rep_on or add_on, repetition=rep_on,
            additive=add_on, stop_ids=sorted(params.all_stop_token_ids), min_tokens=params.min_tokens,
            bad_single=sorted({w[0] for w in bad if len(w) == 1}), bad_multi=bad_multi, allowed=allowed,
            bias_ids=bias_ids, bias_vals=bias_vals, num_logprobs=n_lp,
            processed=params.logprobs_mode == "processed_logprobs", position=len(output_token_ids),
            output=list(output_token_ids) if bad_multi else None,
        )
        if rep_on or add_on:
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
        self.seen.append(slots, token_ids)

    def output_counts(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense (output counts [V], seen-in-prompt-or-output mask [V]) of a penalised slot (tests)."""
        return self.seen.dense_counts(slot, self.vocab_size)

    def metadata(self, slots: list[int]) -> SamplingMetadata:
        """The step's metadata (a fresh object: callers set fields of their own, e.g. grammar_bitmask)."""
        key = (self._generation, *slots)
        if self._last is not None and self._last[0] == key:
            positions = [self._slots[s].position for s in slots]  # type: ignore[union-attr]
            return dataclasses.replace(self._last[1], positions=long_tensor(positions, self.device))
        md, follows_tokens = self._build(slots)
        self._last = None if follows_tokens else (key, md)
        return dataclasses.replace(md)

    def _build(self, slots: list[int]) -> tuple[SamplingMetadata, bool]:
        """(the metadata, whether some row's penalties or bans follow its tokens so far: then it is rebuilt each
        step)."""
        dev = self.device
        infos = [self._slots[s] for s in slots]
        assert all(i is not None for i in infos), "metadata() for a slot with no request"
        greedy, trunc, plain, pen_rows = [], [], [], []
        ban_r: list[int] = []
        ban_t: list[int] = []
        bias_r, bias_t, bias_v, allow_rows, allow_local, allow_ids = [], [], [], [], [], []
        raw_rows, proc_rows = [], []
        max_top_k = 0
        trunc_k: list[int] = []
        kernel: list[int] = []
        any_top_p = any_min_p = False
        max_lp = -1
        follows_tokens = False
        for row, info in enumerate(infos):
            assert info is not None
            if info.greedy:
                greedy.append(row)
            elif info.truncated:
                trunc.append(row)
                trunc_k.append(info.top_k)
                max_top_k = max(max_top_k, info.top_k)
                any_top_p |= info.top_p_on
                any_min_p |= info.min_p_on
            else:
                plain.append(row)
            if not info.greedy and info.top_k <= KERNEL_MAX_TOP_K and not (info.num_logprobs >= 0 and info.processed):
                kernel.append(row)
            if info.penalties:
                pen_rows.append(row)
                follows_tokens = True
            if info.bad_single:
                ban_r += [row] * len(info.bad_single)
                ban_t += info.bad_single
            if info.bad_multi:
                follows_tokens = True
                out = info.output or []
                for word in info.bad_multi:
                    n = len(word) - 1
                    if len(out) >= n and out[-n:] == word[:-1]:
                        ban_r.append(row)
                        ban_t.append(word[-1])
            if info.position < info.min_tokens and info.stop_ids:
                follows_tokens = True
                ban_r += [row] * len(info.stop_ids)
                ban_t += info.stop_ids
            if info.bias_ids is not None:
                bias_r.append(torch.full_like(info.bias_ids, row))
                bias_t.append(info.bias_ids)
                bias_v.append(info.bias_vals)
            if info.allowed is not None:
                allow_local.append(torch.full_like(info.allowed, len(allow_rows)))
                allow_rows.append(row)
                allow_ids.append(info.allowed)
            if info.num_logprobs >= 0:
                (proc_rows if info.processed else raw_rows).append(row)
                max_lp = max(max_lp, info.num_logprobs)

        def rows_t(rows: list[int]) -> torch.Tensor:
            return long_tensor(rows, dev)

        positions = [info.position for info in infos]  # type: ignore[union-attr]
        cpu_idx = long_tensor(slots)
        floats = self._f.index_select(0, cpu_idx).t().to(dev).contiguous()
        ints = self._i.index_select(0, cpu_idx).t().to(dev).contiguous()
        temperature, top_p, min_p, rep, pres, freq = floats.unbind(0)
        top_k, seeds, num_logprobs, greedy_flag, seed_keys = ints.unbind(0)
        penalties = None
        if pen_rows:
            pslots = [slots[r] for r in pen_rows]
            ids, counts, seen = self.seen.gather(pslots)
            prow = rows_t(pen_rows)
            penalties = PenaltyBatch(
                prow, ids, counts, seen, rep.index_select(0, prow), pres.index_select(0, prow),
                freq.index_select(0, prow),
                any(self._slots[s].repetition for s in pslots),  # type: ignore[union-attr]
                any(self._slots[s].additive for s in pslots),  # type: ignore[union-attr]
            )
        md = SamplingMetadata(
            temperature=temperature,
            is_greedy=greedy_flag.bool(),
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seeds=seeds,
            seed_keys=seed_keys,
            positions=long_tensor(positions, dev),
            num_logprobs=num_logprobs,
            greedy_rows=rows_t(greedy),
            truncated_rows=rows_t(trunc),
            plain_rows=rows_t(plain),
            all_greedy=len(greedy) == len(slots),
            any_greedy=bool(greedy),
            max_top_k=max_top_k,
            truncated_top_k=trunc_k,
            any_top_p=any_top_p,
            any_min_p=any_min_p,
            truncated_list=trunc,
            plain_list=plain,
            kernel_rows=kernel,
            allowed=(rows_t(allow_rows), torch.cat(allow_local), torch.cat(allow_ids)) if allow_rows else None,
            banned=(rows_t(ban_r), rows_t(ban_t)) if ban_r else None,
            bias=(torch.cat(bias_r), torch.cat(bias_t), torch.cat(bias_v)) if bias_r else None,
            penalties=penalties,
            max_num_logprobs=max_lp,
            raw_logprob_rows=rows_t(raw_rows),
            processed_logprob_rows=rows_t(proc_rows),
        )
        return md, follows_tokens


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
