"""Beam search on /v1/completions (`use_beam_search: true`, `n` = beam width, `length_penalty`).

Drives tokenspout.engine.beam_search.BeamSearch over the AsyncLLM: each step scores every running beam of every
prompt concurrently (one single-token request with the top 2n logprobs each).  Not streamable: the best beams are
only known at the end (a streamed request with use_beam_search is a 400).
"""

from __future__ import annotations

import asyncio
import itertools

from tokenspout.engine.beam_search import BeamSearch
from tokenspout.entrypoints.openai.protocol import CompletionChoice, CompletionResponse, UsageInfo
from tokenspout.entrypoints.openai.serving_common import PromptState
from tokenspout.sampling_params import RequestOutputKind, SamplingParams


async def beam_search_completion(engine, request_id: str, created: int, prompts: list[str | list[int]], width: int,
                                 request_params: SamplingParams, length_penalty: float,
                                 echo: bool, states: list[PromptState] | None = None) -> CompletionResponse:
    """`request_params`: the request's own params, for its max_tokens (checked against every prompt's room as a
    sampled request's is: a max_tokens that does not fit is a 400 before any search).  `states`: one per prompt,
    given each choice's finish reason and token count for the metrics (the caller finishes them)."""
    processor = engine.processor
    ids = [processor.tokenize(p) for p in prompts]
    max_tokens = min(processor.max_tokens_for(request_params, len(i)) for i in ids)
    search = BeamSearch(ids, width, max_tokens, processor.eos_token_id, length_penalty)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * width, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    counter = itertools.count()

    async def score(seq: list[int]) -> dict[int, float]:
        last = None
        async for out in engine.generate(seq, params, f"{request_id}-beam-{next(counter)}"):
            last = out
        assert last is not None
        return {t: lp.logprob for t, lp in last.outputs[0].logprobs[0].items()}

    while not search.done:
        search.step(list(await asyncio.gather(*[score(s) for s in search.pending()])))
    choices, completion_tokens = [], 0
    for p, (prompt, prompt_ids, hyps) in enumerate(zip(prompts, ids, search.results())):
        prefix = (prompt if isinstance(prompt, str) else engine.tokenizer.decode(prompt_ids)) if echo else ""
        for j, h in enumerate(hyps[:width]):
            completion_tokens += len(h.token_ids)
            ended = bool(h.token_ids) and h.token_ids[-1] == search.eos
            choices.append(CompletionChoice(
                index=p * width + j, text=prefix + engine.tokenizer.decode(h.token_ids, skip_special_tokens=True),
                finish_reason="stop" if ended else "length"))
            if states is not None:
                states[p].prompt_token_ids = prompt_ids
                states[p].choices[j].finish_reason = "stop" if ended else "length"
                states[p].choices[j].num_tokens = len(h.token_ids)
    prompt_tokens = sum(len(i) for i in ids)
    return CompletionResponse(id=request_id, created=created, model=engine.model_name, choices=choices,
                              usage=UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                              total_tokens=prompt_tokens + completion_tokens))
