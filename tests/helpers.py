"""Small utilities shared by tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from tokenspout.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from tokenspout.core.engine_core import EngineCore
from tokenspout.engine.messages import EngineCoreRequest
from tokenspout.kernels import cpu
from tokenspout.models.quantize import pack_int5
from tokenspout.sampling_params import SamplingParams


def make_core(loaded, *, budget: int = 512, max_num_seqs: int = 64, num_blocks: int | None = None,
              block_size: int = 16, prefix_caching: bool = True, kv_cache_dtype: str = "auto",
              async_scheduling: bool = False, batch_invariant: bool = False,
              speculative: SpeculativeConfig | None = None) -> EngineCore:
    # (max_model_len left to the loaded model's: lowered to what a forced small cache holds)
    cfg = EngineConfig(model=ModelConfig(model=str(loaded.path), batch_invariant=batch_invariant),
                       speculative=speculative or SpeculativeConfig(),
                       cache=CacheConfig(block_size=block_size, num_gpu_blocks_override=num_blocks,
                                         enable_prefix_caching=prefix_caching, kv_cache_dtype=kv_cache_dtype),
                       scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                                 async_scheduling=async_scheduling))
    return EngineCore(cfg, loaded=loaded)


def run_to_completion(core: EngineCore, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                      max_steps: int = 100_000) -> dict[str, list[int]]:
    """Adds every prompt (ids "0".."N-1"), steps until all finish, returns the generated ids per request."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for i, (ids, p) in enumerate(zip(prompts, plist)):
        core.add_request(EngineCoreRequest(str(i), ids, p))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    finished: set[str] = set()
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            break
        for o in core.step().outputs:
            assert o.request_id not in finished, "output after finish"
            out[o.request_id].extend(o.new_token_ids)
            if o.finished:
                finished.add(o.request_id)
    assert finished == set(out), "not every request finished"
    return out


@contextmanager
def real_engine(**config: Any) -> Iterator[Any]:
    """The real AsyncLLM (engine-core process) on the default model; `config`: build_engine_config's keywords
    (default: a 1024-token context and a 0.25 GiB KV cache, enough for the e2e tests)."""
    from tokenspout.engine.async_llm import AsyncLLM
    from tokenspout.engine.llm import build_engine_config

    engine = AsyncLLM(build_engine_config(None, **{"max_model_len": 1024, "kv_cache_memory": 0.25, **config}))
    try:
        yield engine
    finally:
        engine.shutdown()


@contextmanager
def background_server(engine: Any, **app_options: Any) -> Iterator[Any]:
    """uvicorn in a thread serving build_app(engine, **app_options); yields the BackgroundServer (its .url)."""
    from tokenspout.entrypoints.openai.api_server import BackgroundServer, build_app

    srv = BackgroundServer(build_app(engine, **app_options)).start()
    try:
        yield srv
    finally:
        srv.stop()


def sse_events(text: str) -> list[dict]:
    """The events of a named-event SSE body (`event: TYPE` then `data: {...,"type": TYPE}` per block: the Responses
    and Anthropic streams), each checked to carry the type its event line names."""
    import json

    out = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        out.append(event)
    return out


def quantize_int5(w: torch.Tensor, lib=None):
    """int5 (a GGUF file's Q5_1 / Q5_K terms: W = scale * q + min, q 0..31) fitted to w per group of 32, as
    quantize_int4 fits int4: (packed weight, dequantized float32 [N, K]).  Packed by torch, or by `lib`."""
    n, k = w.shape
    g = w.float().view(n, k // 32, 32)
    lo = g.amin(-1).half().float()
    scale = ((g.amax(-1) - lo) / 31.0).half().float()
    q = torch.where(scale[..., None] > 0, torch.round((g - lo[..., None]) / scale[..., None].clamp_min(1e-30)), 0)
    q = q.clamp_(0, 31)
    deq = (q * scale[..., None] + lo[..., None]).view(n, k)
    return pack_int5(q.to(torch.uint8), scale.half(), lo.half(), lib), deq


def kernel_levels() -> list[str]:
    """The kernels' ISA levels the tests run at: each this CPU has, and each it lacks built on SIMDe's intrinsics
    (named `<isa>-emulated`: an AVX2-only CPU still tests the AVX-512 code)."""
    return [*cpu.available_isas(), *(f"{isa}-emulated" for isa in cpu.emulated_isas())]


def kernel_lib(level: str):
    """The kernels' library of a kernel_levels() name."""
    if level.endswith("-emulated"):
        return cpu.load_emulated(level.removesuffix("-emulated"))
    return cpu.load(level)
