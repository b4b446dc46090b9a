"""tokenspout: an OpenAI-compatible LLM inference server (the path from logits to streamed text)."""

from tokenspout.outputs import CompletionOutput, RequestOutput
from tokenspout.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "AsyncLLM", "CompletionOutput", "RequestOutput", "RequestOutputKind", "SamplingParams"]


def __getattr__(name: str):
    # Lazy: importing tokenspout for SamplingParams must not import torch and the engine.
    if name == "LLM":
        from tokenspout.engine.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from tokenspout.engine.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(name)
