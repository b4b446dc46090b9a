"""A deterministic stand-in for AsyncLLM that meets the server's EngineClient contract, for tests without a model.

- Prompts are tokenized one character per token; generated tokens are words from a fixed list (some multi-byte).
- Output is a pure function of (prompt ids, seed, choice index): greedy (temperature 0) ignores the seed and gives
  the same text for every choice; a seeded request is reproducible; an unseeded sampled one is random.
- It honours max_tokens (None: until max_model_len), min_tokens, ignore_eos (else it may end on EOS), stop strings
  (excluded or included), stop_token_ids, logprobs (sampled token first, then the top-N) and the three output kinds.
- Like the real engine it raises ValueError at the first __anext__ for bad input (prompt longer than the context,
  token ids outside the vocabulary of 49152, including logit_bias / allowed_token_ids / stop_token_ids).
- Test hooks: `token_delay` (seconds per step), `kill()` (the engine dies: in-flight and new requests raise
  EngineDeadError, `errored` turns true), and `records[request_id]` telling how each generator ended.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import random
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tokenspout.engine.exceptions import EngineDeadError
from tokenspout.outputs import CompletionOutput, Logprob, RequestOutput
from tokenspout.sampling_params import RequestOutputKind, SamplingParams

VOCAB_SIZE = 49152
EOS_ID = 2
_WORD_BASE = 10
_CHAR_BASE = 1000  # prompt characters: id = _CHAR_BASE + ord(c) (ord < 48000), else _UNKNOWN_ID
_UNKNOWN_ID = 3
WORDS = [
    " the", " a", " cat", " dog", " sat", " on", " mat", " and", " ran", " far", " away", " quickly", " blue",
    " sky", " over", " hills", " river", " flows", " to", " sea", ".", ",", " café", " naïve", " 你好", " 🙂",
    " tokens", " stream", " server", " fast", " slow", " light", " dark", " night", " day", " sun", " moon",
    " star", " tree", " leaf", " wind", " rain", " snow", " fire", " stone", " water", " bread", " milk", "!",
]


class FakeTokenizer:
    eos_token_id = EOS_ID
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [_CHAR_BASE + ord(c) if ord(c) < VOCAB_SIZE - _CHAR_BASE else _UNKNOWN_ID for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        out = []
        for t in ids:
            if _WORD_BASE <= t < _WORD_BASE + len(WORDS):
                out.append(WORDS[t - _WORD_BASE])
            elif t >= _CHAR_BASE:
                out.append(chr(t - _CHAR_BASE))
            elif t == EOS_ID and not skip_special_tokens:
                out.append("<|endoftext|>")
            elif t == _UNKNOWN_ID:
                out.append("?")
        return "".join(out)


@dataclass
class RequestRecord:
    request_id: str
    prompt_token_ids: list[int] = field(default_factory=list)
    outcome: str = "running"  # "finished" | "closed" (consumer left early) | "rejected" | "dead" | "aborted"
    closed: threading.Event = field(default_factory=threading.Event)  # set when the generator ended, any way


@dataclass
class _Plan:
    """One choice, decided up front: tokens, the final text and how it ends."""

    token_ids: list[int]
    token_texts: list[str]
    text: str
    finish_reason: str
    stop_reason: int | str | None


def _rng(*parts: object) -> random.Random:
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


class FakeEngine:
    def __init__(self, model_name: str = "fake-model", max_model_len: int = 1024, token_delay: float = 0.0) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.tokenizer = FakeTokenizer()
        self.token_delay = token_delay
        self.records: dict[str, RequestRecord] = {}
        self._dead = False
        self.was_shut_down = False
        self._aborted: set[str] = set()

    # ------------------------------------------------------------------ contract
    @property
    def errored(self) -> bool:
        return self._dead

    def kill(self) -> None:
        self._dead = True

    async def check_health(self) -> None:
        if self._dead:
            raise EngineDeadError("fake engine was killed")

    def shutdown(self) -> None:
        self._dead = True
        self.was_shut_down = True

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    def get_metrics_snapshot(self) -> dict:
        running = sum(r.outcome == "running" for r in self.records.values())
        return {"num_running": running, "num_waiting": 0, "kv_cache_usage": min(1.0, running / 64)}

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kw: object) -> str:
        parts = []
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
                raise ValueError(f"each message needs a role and string content, got {m!r}")
            parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    async def generate(
        self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str, *,
        add_special_tokens: bool | None = None,
    ) -> AsyncIterator[RequestOutput]:
        rec = RequestRecord(request_id)
        self.records[request_id] = rec
        try:
            if self._dead:
                raise EngineDeadError("fake engine was killed")
            prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rec.prompt_token_ids = prompt_ids
            self._validate(prompt_ids, sampling_params)
            plans = [self._plan(prompt_ids, sampling_params, i) for i in range(sampling_params.n)]
            prompt_text = prompt if isinstance(prompt, str) else None
            async for out in self._steps(request_id, prompt_text, prompt_ids, sampling_params, plans):
                yield out
            rec.outcome = "aborted" if request_id in self._aborted else "finished"
        except ValueError:
            rec.outcome = "rejected"
            raise
        except EngineDeadError:
            rec.outcome = "dead"
            raise
        except (GeneratorExit, asyncio.CancelledError):
            rec.outcome = "closed"  # what the real AsyncLLM turns into an abort
            raise
        finally:
            rec.closed.set()

    # ------------------------------------------------------------------ internals
    def _validate(self, prompt_ids: list[int], sp: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("prompt must not be empty")
        if any(not 0 <= t < VOCAB_SIZE for t in prompt_ids):
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {VOCAB_SIZE})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(prompt_ids)} tokens long; this model's context is {self.max_model_len} tokens"
            )
        sp.validate_for_vocab(VOCAB_SIZE)

    def _plan(self, prompt_ids: list[int], sp: SamplingParams, choice: int) -> _Plan:
        if sp.is_greedy:
            rng = _rng("greedy", prompt_ids)  # every choice of a greedy request is the same
        elif sp.seed is not None:
            rng = _rng("seed", sp.seed, choice, prompt_ids)
        else:
            rng = random.Random()
        budget = self.max_model_len - len(prompt_ids)
        limit = budget if sp.max_tokens is None else min(sp.max_tokens, budget)
        vocab = [t for t in (sp.allowed_token_ids or []) if _WORD_BASE <= t < _WORD_BASE + len(WORDS)]
        vocab = vocab or list(range(_WORD_BASE, _WORD_BASE + len(WORDS)))
        ids: list[int] = []
        finish, stop_reason = "length", None
        for i in range(limit):
            if not sp.ignore_eos and i >= sp.min_tokens and rng.random() < 0.04:
                ids.append(EOS_ID)
                finish, stop_reason = "stop", None
                break
            tok = rng.choice(vocab)
            ids.append(tok)
            if tok in sp.stop_token_ids and i + 1 >= sp.min_tokens:
                finish, stop_reason = "stop", tok
                break
        texts = ["" if t == EOS_ID or t in sp.stop_token_ids else self.tokenizer.decode([t]) for t in ids]
        text, cut = "".join(texts), None
        # The earliest stop string ends the text (and the tokens after the one that completed it).
        for s in sp.stop:
            pos = text.find(s)
            if pos >= 0 and (cut is None or pos < cut[0]):
                cut = (pos, s)
        if cut is not None:
            pos, s = cut
            end, n_tok = pos + len(s), 0
            while sum(len(x) for x in texts[:n_tok]) < end:
                n_tok += 1
            ids, texts = ids[:n_tok], texts[:n_tok]
            text = text[: end if sp.include_stop_str_in_output else pos]
            finish, stop_reason = "stop", s
        return _Plan(ids, texts, text, finish, stop_reason)

    def _logprobs(self, sp: SamplingParams, token_id: int, position: int) -> dict[int, Logprob]:
        n = sp.logprobs or 0
        rank = 1 if sp.is_greedy else 1 + (token_id + position) % 3
        others = [t for t in range(_WORD_BASE, _WORD_BASE + len(WORDS)) if t != token_id]
        start = (token_id * 7 + position) % len(others)
        others = others[start:] + others[:start]

        def lp(r: int) -> float:
            return -0.25 * r - 0.01 * (position % 7)

        out = {token_id: Logprob(lp(rank), rank, self.tokenizer.decode([token_id]))}
        for r in range(1, n + 1):
            if r != rank:
                t = others.pop(0)
                out[t] = Logprob(lp(r), r, self.tokenizer.decode([t]))
        return out

    async def _steps(
        self, request_id: str, prompt: str | None, prompt_ids: list[int], sp: SamplingParams, plans: list[_Plan]
    ) -> AsyncIterator[RequestOutput]:
        emitted = [0] * len(plans)  # characters of each final text already sent (DELTA)
        cum = [[0, *itertools.accumulate(len(t) for t in p.token_texts)] for p in plans]
        steps = max(len(p.token_ids) for p in plans)
        delta = sp.output_kind == RequestOutputKind.DELTA
        for step in range(steps):
            await self._sleep()
            finished = step == steps - 1
            if request_id in self._aborted:
                outs = [CompletionOutput(i, "", [], finish_reason="abort") for i in range(len(plans))]
                yield RequestOutput(request_id, prompt, prompt_ids, outs, finished=True)
                return
            if sp.output_kind == RequestOutputKind.FINAL_ONLY:
                if finished:
                    outs = [self._final(p, i, sp) for i, p in enumerate(plans)]
                    yield RequestOutput(request_id, prompt, prompt_ids, outs, finished=True)
                continue
            outs = []
            for i, p in enumerate(plans):
                if step >= len(p.token_ids):
                    continue  # this choice already finished
                last = step == len(p.token_ids) - 1
                # Never show text past the final text: an excluded stop string must not leak into a delta.
                shown = len(p.text) if last else min(cum[i][step + 1], len(p.text))
                first = step if delta else 0
                lps = None
                if sp.logprobs is not None:
                    lps = [self._logprobs(sp, p.token_ids[j], j) for j in range(first, step + 1)]
                outs.append(CompletionOutput(
                    index=i,
                    text=p.text[emitted[i]:shown] if delta else p.text[:shown],
                    token_ids=p.token_ids[first: step + 1],
                    logprobs=lps,
                    finish_reason=p.finish_reason if last else None,
                    stop_reason=p.stop_reason if last else None,
                ))
                emitted[i] = shown
            yield RequestOutput(request_id, prompt, prompt_ids, outs, finished=finished)

    def _final(self, p: _Plan, i: int, sp: SamplingParams) -> CompletionOutput:
        lp = [self._logprobs(sp, t, j) for j, t in enumerate(p.token_ids)] if sp.logprobs is not None else None
        return CompletionOutput(i, p.text, list(p.token_ids), logprobs=lp, finish_reason=p.finish_reason,
                                stop_reason=p.stop_reason)

    async def _sleep(self) -> None:
        # Sleep in short slices so that kill() (called from another thread) is noticed promptly.
        remaining = self.token_delay
        while True:
            if self._dead:
                raise EngineDeadError("fake engine was killed")
            if remaining <= 0:
                await asyncio.sleep(0)
                return
            await asyncio.sleep(min(remaining, 0.01))
            remaining -= 0.01
