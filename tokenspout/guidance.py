"""Classifier-free guidance (CFG), in one place: logits = uncond + s * (cond - uncond).

A guided request (`guidance_scale != 1`) runs with an unconditional *companion*: a second sequence over the
negative prompt, with its own tokens and KV blocks.  The pair lives and dies together:

* The negative prompt (frontend): the user's `negative_prompt`, else by default the chat template around an empty
  user message for chat (`chat_negative_prompt`), BOS for completions; the Processor tokenizes it into
  `negative_prompt_token_ids` (`negative_prompt_ids`).

* Creation (`make_companion`, from EngineCore.add_request): the companion shares the request's params and seed,
  is marked `is_companion` and never samples: it takes the tokens its request samples (`advance_companion`).
* Scheduling and allocation (called by the Scheduler): the pair is planned, allocated and preempted as a unit
  (`plan_pair`, `pair_block_asks`, `release_companion`); it samples only in a step where both sequences reach the
  end of their known tokens (`pair_samples`), and counts as two rows toward max_num_seqs (`num_rows`).  A batch
  holding a pair steps synchronously under async scheduling (`needs_sync_step`): the companion's next input is the
  token its request samples.
* The logit combination (`combine`, from the model runner): the companion's last position in the same step gives
  uncond; one fused lerp over every guided row.

This module imports nothing of core/ or worker/ at run time (both use it; types only for annotations), nor torch
until a step combines logits (the frontend uses it too, and never loads torch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from tokenspout.engine.messages import EngineCoreRequest

if TYPE_CHECKING:
    import torch

    from tokenspout.core.kv_cache_manager import BlockAsk
    from tokenspout.core.request import Request, RequestStatus
    from tokenspout.step_io import ScheduledRequest


# ---- the negative prompt (frontend) ------------------------------------------------------------------------------
def chat_negative_prompt(apply_chat_template: Callable[[list[dict[str, str]]], str]) -> str:
    """The default unconditional prompt of a chat request: the template around an empty user message."""
    return apply_chat_template([{"role": "user", "content": ""}])


def negative_prompt_ids(negative_prompt: str | None, encode: Callable[[str], list[int]] | None,
                        bos_token_id: int | None, eos_token_id: int | None, max_model_len: int) -> list[int]:
    """The companion's prompt: `negative_prompt` tokenized (`encode`; None without a tokenizer), else BOS (EOS if
    the model has no BOS)."""
    if negative_prompt is not None:
        if not negative_prompt or encode is None:
            raise ValueError("negative_prompt must be a non-empty string")
        ids = encode(negative_prompt)
        if len(ids) >= max_model_len:
            raise ValueError(f"negative_prompt has {len(ids)} tokens; the model's limit is {max_model_len}")
        return ids
    first = bos_token_id if bos_token_id is not None else eos_token_id
    if first is None:
        raise ValueError("guidance_scale needs a negative_prompt for a model without BOS/EOS tokens")
    return [first]


# ---- creation ----------------------------------------------------------------------------------------------------
def make_companion(request: Request, core_request: EngineCoreRequest, seed: int, max_model_len: int) -> None:
    """Gives a guided request its unconditional companion (request.companion)."""
    neg = core_request.sampling_params.negative_prompt_token_ids
    if not neg:
        raise ValueError("guidance_scale needs negative_prompt_token_ids (the frontend fills them)")
    companion = type(request)(EngineCoreRequest(f"{request.request_id}#cfg", list(neg), core_request.sampling_params,
                                                core_request.arrival_time), seed, max_model_len)
    companion.is_companion = True
    request.companion = companion


# ---- scheduling and allocation -------------------------------------------------------------------------------
def sequences(req: Request) -> tuple[Request, ...]:
    """The sequences a request schedules: itself, then its companion if guided."""
    return (req,) if req.companion is None else (req, req.companion)


def num_rows(requests: Iterable[Request]) -> int:
    """Rows (sequences) the requests hold: a guided request and its companion count as two."""
    return sum(1 if r.companion is None else 2 for r in requests)


def plan_pair(req: Request, comp: Request, rem: int, budget: int) -> tuple[int, int]:
    """Tokens to compute this step for a guided request with `rem` tokens left and for its companion.  A pair only
    samples when both reach the end of their known tokens in the same step, so while they cannot both finish,
    each keeps its last token for that step."""
    rem_c = comp.num_tokens_with_placeholders - comp.num_scheduled_tokens
    if rem + rem_c <= budget:
        return rem, rem_c
    m = min(max(rem - 1, 0), budget)
    return m, min(max(rem_c - 1, 0), budget - m)


def pair_block_asks(asks: list[BlockAsk], req: Request, comp_new: int, hits: list[int]) -> list[BlockAsk]:
    """The block asks of a request (`asks`) plus its companion's, so both are allocated or neither is."""
    comp = req.companion
    if comp is None:
        return asks
    # imported here (only for a guided pair: every allocation comes through this function): worker/ imports this
    # module for the logit combination and must not import core/
    from tokenspout.core.kv_cache_manager import BlockAsk

    return [*asks, BlockAsk(comp.request_id, comp.num_scheduled_tokens + comp_new, hits)]


def pair_samples(req: Request, comp_new: int, reaches_end: bool) -> bool:
    """Whether the step samples for a request that reaches the end of its tokens (`reaches_end`): a guided pair
    samples only when its companion reaches the end of its own in the same step."""
    comp = req.companion
    if comp is None:
        return reaches_end
    return reaches_end and comp.num_scheduled_tokens + comp_new == comp.num_tokens_with_placeholders


def release_companion(comp: Request, status: RequestStatus, free: Callable[[str], None], had_row: bool,
                      removed: list[str]) -> None:
    """The pair was finished or preempted (`status`): the companion's blocks go back (`free`) and its KV counts
    reset (it is recomputed with its request); it gives its row back when it had one."""
    comp.status = status
    free(comp.request_id)
    comp.num_computed_tokens = comp.num_inflight_tokens = comp.num_placeholders = 0
    if had_row:
        removed.append(comp.request_id)


def advance_companion(req: Request, accepted: list[int]) -> None:
    """Both sequences advance with the token the pair sampled."""
    if req.companion is not None:
        req.companion.token_ids.extend(accepted)


def needs_sync_step(requests: Iterable[Request]) -> bool:
    """Whether any request is guided: its companion's next input is the token sampled this step, so the next step
    cannot be scheduled before this one's results are in (async scheduling)."""
    return any(r.companion is not None for r in requests)


# ---- the logit combination -------------------------------------------------------------------------------------
def combine(logits: torch.Tensor, entries: Sequence[ScheduledRequest], sample_idx: list[int],
            query_start_loc: torch.Tensor, hidden: torch.Tensor,
            project: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """In place: the rows of guided requests (logits row r = entries[sample_idx[r]]) become
    uncond + s * (cond - uncond), one fused lerp over every guided row; each companion's logits are `project`ed
    from its own last position in this step's hidden states."""
    pos = {e.request.request_id: j for j, e in enumerate(entries)}
    rows, comp_pos, scales = [], [], []
    for r, i in enumerate(sample_idx):
        comp = entries[i].request.companion
        if comp is not None:
            rows.append(r)
            comp_pos.append(int(query_start_loc[pos[comp.request_id] + 1]) - 1)
            scales.append(entries[i].request.params.guidance_scale)
    if not rows:
        return
    import torch  # here: the frontend imports this module (the negative prompt) and never needs torch

    uncond = project(hidden[torch.tensor(comp_pos, dtype=torch.int64)])
    rows_t = torch.tensor(rows, dtype=torch.int64)
    scale = torch.tensor(scales, dtype=logits.dtype)[:, None]
    logits[rows_t] = torch.lerp(uncond, logits[rows_t], scale)
