"""SamplingParams: every generation knob, validated, with neutral defaults.

Neutral values mean "off": temperature 1, top_k 0 (-1 accepted), top_p 1, min_p 0,
presence/frequency penalty 0, repetition penalty 1.  Errors the user can cause raise
ValueError naming the field and the allowed range (the server maps them to HTTP 400).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenspout.checks import is_int, is_number

# Temperatures below this are treated as greedy (as vLLM does); the sampler guards the division.
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
LOGIT_BIAS_CLAMP = 100.0
# vLLM's seed range (a torch.long).
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1

# (field, low, high, low excluded, the rule a 400 states); _HALF_OPEN fields also exclude `high`.
_WARPER_RANGES = (
    ("typical_p", 0.0, 1.0, True, "in (0, 1] (1 = off)"),
    ("epsilon_cutoff", 0.0, 1.0, False, "in [0, 1) (0 = off)"),
    ("eta_cutoff", 0.0, 1.0, False, "in [0, 1) (0 = off)"),
    ("top_n_sigma", 0.0, 100.0, False, "in [0, 100] (0 or -1 = off)"),
    ("xtc_probability", 0.0, 1.0, False, "in [0, 1] (0 = off)"),
    ("xtc_threshold", 0.0, 1.0, False, "in [0, 1] (above 0.5: off)"),
    ("dynatemp_range", 0.0, 100.0, False, "in [0, 100] (0 = off)"),
    ("dynatemp_exponent", 0.0, 100.0, False, "in [0, 100]"),
)
_HALF_OPEN = ("epsilon_cutoff", "eta_cutoff")
MAX_NGRAM = 64  # no_repeat_ngram_size bound: each step looks up an (n-1)-token key
DRY_DEFAULT_BREAKERS = ("\n", ":", "\"", "*")  # llama.cpp's defaults
MAX_DRY_BREAKERS = 64  # dry_sequence_breakers: at most this many strings ...
MAX_DRY_BREAKER_CHARS = 40  # ... of at most this many characters (llama.cpp truncates there)
MAX_DRY_LAST_N = 1 << 20
MAX_THINKING_BUDGET = 1 << 20
MAX_STOP_CHARS = 1024  # a stop string's length: streams follow each with an automaton built from it (stop_checker)
MAX_N = 1 << 16  # choices per request offline (the server's bound is OpenAI's 128): n = 10^18 built ids for ever
# The fields' types as the engine's message schema holds them (SamplingParams._validate_types)
_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens",
               "no_repeat_ngram_size", "mirostat", "thinking_token_budget", "dry_allowed_length", "dry_penalty_last_n")
_BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                "detokenize")
_INT_LIST_FIELDS = ("stop_token_ids", "allowed_token_ids")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "guidance_scale", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_n_sigma", "xtc_probability",
                 "xtc_threshold", "dynatemp_range", "dynatemp_exponent", "mirostat_tau", "mirostat_eta",
                 "dry_multiplier", "dry_base")


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every RequestOutput carries the whole text so far
    DELTA = 1  # every RequestOutput carries only what is new since the last one
    FINAL_ONLY = 2  # one RequestOutput, when the request finishes


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrains the output to a grammar; exactly one field is set.  `json` is a JSON-schema document serialised
    as a string (so it crosses the process boundary as plain data)."""

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark / EBNF as llguidance accepts
    json_object: bool = False  # any JSON object
    # Set by the server's reasoning parser: the grammar applies only after the first occurrence of this text (the
    # reasoning's end marker); before it, any text.  Not a user field.
    reasoning_end: str | None = None
    # With reasoning_end: the reasoning is optional and opened by this text (qwen3: a reply that does not open with
    # `<think>` is all answer, so the grammar must apply from its first token).  None: the reply starts inside it.
    reasoning_start: str | None = None
    # Set by the API server: the request field the constraint came from ("response_format", "guided_regex", ...),
    # which an invalid grammar's error names.  Not part of the grammar (nor of its cache key).
    source: str | None = None

    def __post_init__(self) -> None:
        set_fields = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        set_fields += ["json_object"] if self.json_object else []
        if len(set_fields) != 1:
            raise ValueError(f"structured_outputs must set exactly one of json, regex, choice, grammar, json_object; "
                             f"got {set_fields or 'none'}")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: until the model's context is full
    # A max_tokens longer than the room the prompt leaves is an error, unless this is set (then it is cut to the
    # room): the server sets it when max_tokens is a default the client did not choose.
    clamp_max_tokens: bool = False
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (0: only the sampled token's)
    # Logprobs of the prompt's tokens (each given the tokens before it) and their top-N alternatives, computed on
    # the prefill's own logits (0: only the prompt token's).  Such a request takes no prefix-cache hits.
    prompt_logprobs: int | None = None
    logprobs_mode: str = "raw_logprobs"  # or "processed_logprobs" (after penalties/temperature/top-k/top-p)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    # Keep only this many prompt tokens (-1: as many as the context allows, leaving room for one generated token),
    # cut from the left (the start: vLLM's default) or the right.
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # Classifier-free guidance: logits = uncond + guidance_scale * (cond - uncond), where uncond comes from the
    # negative prompt (default: the chat template with an empty user message for chat, BOS for completions).
    guidance_scale: float = 1.0
    negative_prompt: str | None = None
    negative_prompt_token_ids: list[int] | None = None  # filled by the frontend Processor
    # Further truncation and reshaping (sample/ops/warpers.py; README "Sampling parameters" has the order and the
    # source of each one's semantics).  Neutral values mean "off"; greedy rows ignore them all.
    typical_p: float = 1.0  # transformers' TypicalLogitsWarper (locally typical sampling)
    epsilon_cutoff: float = 0.0  # transformers' EpsilonLogitsWarper
    eta_cutoff: float = 0.0  # transformers' EtaLogitsWarper
    top_n_sigma: float = 0.0  # llama.cpp: keep logits >= max - n * std (0 = off; -1 accepted as off)
    xtc_probability: float = 0.0  # llama.cpp's XTC: chance per step of excluding the top choices
    xtc_threshold: float = 0.1  # ... the tokens with p >= this, all but the least likely of them
    dynatemp_range: float = 0.0  # llama.cpp's entropy-scaled temperature in [T - range, T + range] (0 = off)
    dynatemp_exponent: float = 1.0
    # Repetition knobs over prompt + output (sample/ops/repeats.py), argmax-changing (greedy rows too), after the
    # penalties.  no_repeat_ngram_size: transformers' NoRepeatNGramLogitsProcessor (0 = off).  DRY: llama.cpp's
    # "don't repeat yourself" (dry_multiplier 0 = off; dry_penalty_last_n -1 = the whole context, 0 = off).
    no_repeat_ngram_size: int = 0
    # Mirostat (sample/ops/mirostat.py; llama.cpp's v1 / v2): 0 = off.  Replaces top-k / top-p / min-p and the
    # warpers (a 400 together with them); the running target mu is per request, carried across preemption.
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    # After this many reasoning tokens the reasoning's end marker is forced (needs a reasoning parser: the server /
    # LLM.chat sets reasoning_end / reasoning_start from it; sample/ops/thinking.py).  None = no budget.
    thinking_token_budget: int | None = None
    reasoning_end: str | None = None
    reasoning_start: str | None = None  # None: the reply starts inside the reasoning
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: list[str] = field(default_factory=lambda: list(DRY_DEFAULT_BREAKERS))
    # Filled by the frontend Processor from the tokenizer (never by users):
    bad_words_token_ids: list[list[int]] | None = None
    dry_sequence_breaker_ids: list[list[int]] | None = None
    reasoning_end_token_ids: list[int] | None = None
    reasoning_start_token_ids: list[int] | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == -1:
            self.top_k = 0
        if self.top_n_sigma == -1:
            self.top_n_sigma = 0.0
        self.validate()

    def _validate_types(self, bad: Callable[[str, str, object], ValueError]) -> None:
        """The types the engine's message schema holds them in (offline callers pass anything): a float logprobs
        or a bool in allowed_token_ids reached the engine process and killed its input thread, which hung every
        later request (audit, 2026-11-27).  bool is no integer here, though Python counts it as one."""
        for name in _INT_FIELDS:
            v = getattr(self, name)
            if v is not None and not is_int(v):
                raise bad(name, "an integer", v)
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "true or false", getattr(self, name))
        for name in _INT_LIST_FIELDS:
            v = getattr(self, name)
            if v is not None and (not isinstance(v, list | tuple) or not all(is_int(t) for t in v)):
                raise bad(name, "a list of integer token ids", v)
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if not is_number(v):
                raise bad(name, "a number", v)
        if self.bad_words is not None and (not isinstance(self.bad_words, list | tuple)
                                           or not all(isinstance(w, str) for w in self.bad_words)):
            raise bad("bad_words", "a list of strings", self.bad_words)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "a StructuredOutputsParams (e.g. StructuredOutputsParams(json=schema))",
                      self.structured_outputs)
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (AttributeError, TypeError, ValueError):
                raise bad("logit_bias", "a dict of token ids to numbers", self.logit_bias) from None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def validate(self) -> None:
        def bad(name: str, rule: str, value: object) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {value!r}")

        self._validate_types(bad)
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"an integer in [1, {MAX_N}]", self.n)
        if not 0.0 <= self.temperature <= 100.0 or self.temperature != self.temperature:
            raise bad("temperature", "in [0, 100]", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]", self.top_p)
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "0 or -1 (off) or a positive integer", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]", self.min_p)
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]", self.presence_penalty)
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "in (0, 2]", self.repetition_penalty)
        if self.prompt_logprobs is not None:
            if self.prompt_logprobs == -1:
                raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got -1: -1 (the whole vocabulary) "
                                 "is not supported, it would send vocab_size logprobs per prompt token to the frontend")
            if not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise bad("prompt_logprobs", f"in [0, {MAX_LOGPROBS}]", self.prompt_logprobs)
        # max_tokens 0 scores the prompt and generates nothing (a loglikelihood eval): only with prompt_logprobs.
        min_max_tokens = 0 if self.prompt_logprobs is not None else 1
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < min_max_tokens):
            raise bad("max_tokens", "an integer >= 1 (0 only with prompt_logprobs)", self.max_tokens)
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"in [0, {MAX_LOGPROBS}]", self.logprobs)
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise bad("logprobs_mode", "'raw_logprobs' or 'processed_logprobs'", self.logprobs_mode)
        if self.seed is not None and (not isinstance(self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise bad("seed", f"an integer in [{SEED_MIN}, {SEED_MAX}]", self.seed)
        if self.truncate_prompt_tokens is not None and (not isinstance(self.truncate_prompt_tokens, int)
                                                        or self.truncate_prompt_tokens < -1
                                                        or self.truncate_prompt_tokens == 0):
            raise bad("truncate_prompt_tokens", "-1 or an integer >= 1", self.truncate_prompt_tokens)
        if self.truncation_side not in ("left", "right"):
            raise bad("truncation_side", "'left' or 'right'", self.truncation_side)
        if any(not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS for s in self.stop):
            long = next((s for s in self.stop if isinstance(s, str) and len(s) > MAX_STOP_CHARS), None)
            raise bad("stop", f"a list of non-empty strings of at most {MAX_STOP_CHARS} characters",
                      self.stop if long is None else f"a string of {len(long)} characters")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative token ids", self.stop_token_ids)
        if self.logit_bias is not None:
            nan = next((k for k, v in self.logit_bias.items() if v != v), None)  # (+-inf clamp to +-100 as any bias)
            if nan is not None:
                raise ValueError(f"logit_bias must map token ids to numbers, got NaN for token {nan}")
        if not 0.0 <= self.guidance_scale <= 100.0 or self.guidance_scale != self.guidance_scale:
            raise bad("guidance_scale", "in [0, 100] (1 = off)", self.guidance_scale)
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            raise bad("allowed_token_ids", "a non-empty list", self.allowed_token_ids)
        self._validate_warpers(bad)
        self._validate_repeats(bad)
        self._validate_mirostat(bad)
        if self.thinking_token_budget is not None and (
                not isinstance(self.thinking_token_budget, int) or isinstance(self.thinking_token_budget, bool)
                or not 0 <= self.thinking_token_budget <= MAX_THINKING_BUDGET):
            raise bad("thinking_token_budget", f"an integer in [0, {MAX_THINKING_BUDGET}]", self.thinking_token_budget)

    def _validate_mirostat(self, bad: Callable[[str, str, object], ValueError]) -> None:
        if self.mirostat not in (0, 1, 2) or isinstance(self.mirostat, bool):
            raise bad("mirostat", "0 (off), 1 or 2", self.mirostat)
        if not isinstance(self.mirostat_tau, (int, float)) or not 0.0 <= self.mirostat_tau <= 100.0:
            raise bad("mirostat_tau", "in [0, 100]", self.mirostat_tau)
        if not isinstance(self.mirostat_eta, (int, float)) or not 0.0 <= self.mirostat_eta <= 10.0:
            raise bad("mirostat_eta", "in [0, 10]", self.mirostat_eta)
        if self.mirostat:
            clash = [name for name, on in (("top_k", self.top_k > 0), ("top_p", self.top_p < 1.0),
                                           ("min_p", self.min_p > 0.0), ("typical_p", self.typical_p < 1.0),
                                           ("epsilon_cutoff", self.epsilon_cutoff > 0.0),
                                           ("eta_cutoff", self.eta_cutoff > 0.0), ("top_n_sigma", self.top_n_sigma > 0),
                                           ("xtc_probability", self.xtc_active),
                                           ("dynatemp_range", self.dynatemp_range > 0.0)) if on]
            if clash:
                raise ValueError(f"mirostat replaces top-k / top-p / min-p and the other truncation samplers (as in "
                                 f"llama.cpp); it cannot be combined with {', '.join(clash)}")

    def _validate_repeats(self, bad: Callable[[str, str, object], ValueError]) -> None:
        if not is_int(self.no_repeat_ngram_size) or not 0 <= self.no_repeat_ngram_size <= MAX_NGRAM:
            raise bad("no_repeat_ngram_size", f"an integer in [0, {MAX_NGRAM}] (0 = off)", self.no_repeat_ngram_size)
        if not isinstance(self.dry_multiplier, (int, float)) or not 0.0 <= self.dry_multiplier <= 100.0:
            raise bad("dry_multiplier", "in [0, 100] (0 = off)", self.dry_multiplier)
        if not isinstance(self.dry_base, (int, float)) or not 1.0 <= self.dry_base <= 100.0:
            raise bad("dry_base", "in [1, 100]", self.dry_base)
        if not is_int(self.dry_allowed_length) or not 0 <= self.dry_allowed_length <= 1024:
            raise bad("dry_allowed_length", "an integer in [0, 1024]", self.dry_allowed_length)
        if not is_int(self.dry_penalty_last_n) or not -1 <= self.dry_penalty_last_n <= MAX_DRY_LAST_N:
            raise bad("dry_penalty_last_n", f"-1 (the whole context), 0 (off) or an integer up to {MAX_DRY_LAST_N}",
                      self.dry_penalty_last_n)
        brk = self.dry_sequence_breakers
        if (not isinstance(brk, list) or len(brk) > MAX_DRY_BREAKERS
                or any(not isinstance(b, str) or not 0 < len(b) <= MAX_DRY_BREAKER_CHARS for b in brk)):
            raise bad("dry_sequence_breakers", f"a list of at most {MAX_DRY_BREAKERS} non-empty strings of at most "
                      f"{MAX_DRY_BREAKER_CHARS} characters", brk)

    def _validate_warpers(self, bad: Callable[[str, str, object], ValueError]) -> None:
        for name, lo, hi, lo_open, rule in _WARPER_RANGES:
            v = getattr(self, name)
            if (not is_number(v) or v != v or v < lo or v > hi
                    or (lo_open and v == lo) or (name in _HALF_OPEN and v == hi)):
                raise bad(name, rule, v)

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Checks that every token id the request names exists in the model's vocabulary."""
        for name, ids in (
            ("logit_bias", list(self.logit_bias or {})),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("stop_token_ids", self.stop_token_ids),
        ):
            for t in ids:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"{name} has token id {t}, outside the vocabulary [0, {vocab_size})")

    @property
    def uses_dry(self) -> bool:
        return self.dry_multiplier > 0.0 and self.dry_penalty_last_n != 0

    @property
    def uses_warpers(self) -> bool:
        """Whether a (random) row of this request takes the warpers' path (sample/ops/warpers.py)."""
        return (self.typical_p < 1.0 or self.epsilon_cutoff > 0.0 or self.eta_cutoff > 0.0 or self.top_n_sigma > 0.0
                or self.xtc_active or self.dynatemp_range > 0.0)

    @property
    def xtc_active(self) -> bool:
        """XTC can act: llama.cpp's rule (a threshold above 0.5 can never have two tokens above it)."""
        return self.xtc_probability > 0.0 and self.xtc_threshold <= 0.5

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def depends_on_output(self, num_output_tokens: int) -> bool:
        """Whether processing this request's logits depends on the tokens it has generated so far: penalties
        (they count them), bad words (a multi-token word is banned after its prefix; speculation treats single
        ones alike), min_tokens not reached yet (stop tokens banned until then), no_repeat_ngram_size and DRY (they
        read the history), mirostat (its mu moves with each token) and a thinking budget (it counts them).  Such a
        row's sampling state is rebuilt each step, and it never verifies drafts (a drafted position's processing
        would need the drafts before it as outputs)."""
        return (self.has_penalties or bool(self.bad_words_token_ids) or num_output_tokens < self.min_tokens
                or self.no_repeat_ngram_size > 0 or self.uses_dry or self.mirostat > 0
                or self.thinking_token_budget is not None)

    @property
    def uses_guidance(self) -> bool:
        return self.guidance_scale != 1.0

    @property
    def all_stop_token_ids(self) -> set[int]:
        ids = set(self.stop_token_ids)
        if self.eos_token_id is not None and not self.ignore_eos:
            ids.add(self.eos_token_id)
        return ids
