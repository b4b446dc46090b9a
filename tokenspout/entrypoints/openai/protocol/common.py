"""Response pieces shared by the chat and completion routes (usage, logprob entries, timestamps) and /v1/models."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, Field

# A client's request id (the X-Request-Id header, or a body's `request_id`): echoed in responses and written to the
# logs, so bounded and printable ASCII only (a newline in it would forge a log line).
MAX_REQUEST_ID_CHARS = 256


def is_printable_id(value: str) -> bool:
    return len(value) <= MAX_REQUEST_ID_CHARS and all(" " <= c <= "~" for c in value)


def _printable_id(value: str) -> str:
    if not is_printable_id(value):
        raise ValueError(f"must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII characters")
    return value


RequestId = Annotated[str, Field(min_length=1, max_length=MAX_REQUEST_ID_CHARS), AfterValidator(_printable_id)]


def unix_now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class PromptLogprob(BaseModel):
    """vLLM's Logprob of one token at one prompt position (rank 1 = most likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per prompt token (the first null): token id (as a string) -> its logprob.
PromptLogprobsJSON = list[dict[str, PromptLogprob] | None]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=unix_now)
    owned_by: str = "tokenspout"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
