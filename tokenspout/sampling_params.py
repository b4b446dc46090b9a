"""SamplingParams: every generation knob, validated, with neutral defaults.

Neutral values mean "off": temperature 1, top_k 0 (-1 accepted), top_p 1, min_p 0,
presence/frequency penalty 0, repetition penalty 1.  Errors the user can cause raise
ValueError naming the field and the allowed range (the server maps them to HTTP 400).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# Temperatures below this are treated as greedy (as vLLM does); the sampler guards the division.
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
LOGIT_BIAS_CLAMP = 100.0
# vLLM's seed range (a torch.long).
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1


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
    # Filled by the frontend Processor from the tokenizer (never by users):
    bad_words_token_ids: list[list[int]] | None = None
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
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def validate(self) -> None:
        def bad(name: str, rule: str, value: object) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {value!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1", self.n)
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
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "a list of non-empty strings", self.stop)
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative token ids", self.stop_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if not 0.0 <= self.guidance_scale <= 100.0 or self.guidance_scale != self.guidance_scale:
            raise bad("guidance_scale", "in [0, 100] (1 = off)", self.guidance_scale)
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            raise bad("allowed_token_ids", "a non-empty list", self.allowed_token_ids)

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
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def depends_on_output(self, num_output_tokens: int) -> bool:
        """Whether processing this request's logits depends on the tokens it has generated so far: penalties
        (they count them), bad words (a multi-token word is banned after its prefix; speculation treats single
        ones alike), or min_tokens not reached yet (stop tokens banned until then).  Such a row's sampling state
        is rebuilt each step, and it never verifies drafts (a drafted position's processing would need the drafts
        before it as outputs)."""
        return self.has_penalties or bool(self.bad_words_token_ids) or num_output_tokens < self.min_tokens

    @property
    def uses_guidance(self) -> bool:
        return self.guidance_scale != 1.0

    @property
    def all_stop_token_ids(self) -> set[int]:
        ids = set(self.stop_token_ids)
        if self.eos_token_id is not None and not self.ignore_eos:
            ids.add(self.eos_token_id)
        return ids
