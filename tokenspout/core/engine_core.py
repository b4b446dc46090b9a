"""The engine core: scheduler + model runner, stepped while work exists.  The same object serves in-process
(offline LLM, tests) and inside EngineCoreProc behind ZMQ."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from tokenspout import guidance
from tokenspout.config import EngineConfig
from tokenspout.core.kv_cache_manager import KVCacheManager
from tokenspout.core.request import Request
from tokenspout.core.scheduler import Scheduler, SchedulerOutput
from tokenspout.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from tokenspout.models.loader import LoadedModel, load_model
from tokenspout.spec_decode.speculator import Speculator, extra_kv_block_bytes, load_draft
from tokenspout.structured_output.lazy import LazyStructuredOutputs
from tokenspout.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def fit_to_cache(max_model_len: int, config: EngineConfig, num_blocks: int, block_bytes: int) -> int:
    """The context length served: max_model_len, or what the KV cache holds when that is less.  A sequence longer
    than the whole cache can never run: such a prompt was accepted, then ended at once with finish_reason "length" and
    no text.  An explicit max_model_len that does not fit is an error (vLLM's rule), naming the memory it needs; the
    model's own length (e.g. 8192 where the default 1 GiB holds ~5.4k positions of the 1.7B shape) is lowered to the
    cache's with a warning, so prompts past it are a clear 400.  (A guided request's companion shares the cache: the
    scheduler still ends a pair that cannot fit together.)"""
    block_size = config.cache.block_size
    holds = num_blocks * block_size
    if max_model_len <= holds:
        return max_model_len
    budget = (f"{num_blocks} blocks (the block count is forced)" if config.cache.num_gpu_blocks_override else
              f"kv_cache_memory (--kv-cache-memory) {config.cache.kv_cache_memory_gib:g} GiB")
    if config.model.max_model_len is not None:
        need = -(-max_model_len // block_size) * block_bytes / (1 << 30)
        raise ValueError(
            f"max_model_len (--max-model-len) {max_model_len} does not fit in the KV cache: {budget} holds "
            f"{holds} positions; one sequence of {max_model_len} needs {need:.2f} GiB. Raise kv_cache_memory or "
            f"lower max_model_len to at most {holds}")
    logger.warning("the KV cache (%s) holds %d positions, fewer than the model's context length %d: serving a "
                   "context of %d (raise --kv-cache-memory for more)", budget, holds, max_model_len, holds)
    return holds


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, defer_cache_write: bool = False):
        """defer_cache_write: see load_model (EngineCoreProc writes the file once it is ready)."""
        config.validate()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        spec = config.speculative
        # (not with a separate draft model: one of the same folder would wait on the cache lock the write holds)
        defer = defer_cache_write and not (spec.method == "draft" and spec.draft_model)
        self.loaded = loaded or load_model(config.model, defer)
        self._tokenizer = None  # the HF tokenizer, for grammars: loaded by warm_up() or the first grammar request
        self._tokenizer_lock = threading.Lock()
        # The grammar manager is made on the first grammar request; its tokenizer is loaded by warm_up().
        self.structured = LazyStructuredOutputs(self._load_tokenizer, self.loaded.arch.vocab_size,
                                                config.scheduler.max_num_seqs)
        draft = load_draft(spec, self.loaded, config.model.quantization)
        self.runner = ModelRunner(self.loaded, config.cache, config.scheduler,
                                  extra_block_bytes=extra_kv_block_bytes(draft, config.cache.block_size),
                                  structured=self.structured, batch_invariant=config.model.batch_invariant)
        # (a model loaded beforehand, as tests share one, was loaded with a max_model_len of its own)
        self.max_model_len = fit_to_cache(config.model.max_model_len or self.loaded.max_model_len, config,
                                          self.runner.num_blocks, self.runner.block_bytes)
        self.kv = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                 enable_prefix_caching=config.cache.enable_prefix_caching)
        self.speculator = (Speculator(spec, self.runner, self.loaded, draft, self.structured)
                           if spec.method is not None else None)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, self.structured,
                                   self.speculator.num_lookahead_tokens if self.speculator is not None else 0)
        # Async scheduling: one thread steps the model (the kernels release the GIL) while this one schedules;
        # speculative decoding drafts from the tokens of the step before, so it always steps synchronously.
        self._stepper: ThreadPoolExecutor | None = None
        self._in_flight: tuple[SchedulerOutput, Future] | None = None
        if config.scheduler.async_scheduling and spec.method is None:
            threads = torch.get_num_threads()  # a thread's OpenMP team size is its own: set it there too
            self._stepper = ThreadPoolExecutor(1, "engine-step", initializer=torch.set_num_threads,
                                               initargs=(threads,))

    def warm_up(self) -> None:
        """Builds what a first grammar request would otherwise wait for: the tokenizer and with it transformers
        (~1 s of imports that the start-up no longer pays), the grammar manager and its backend (llguidance's view
        of the vocabulary).  EngineCoreProc runs it once, in a thread beside the steps, right after READY; safe
        against a grammar request arriving meanwhile (both build under locks, once)."""
        self.structured.get().build_backend()

    def _load_tokenizer(self) -> Any:
        """The HF tokenizer, for grammars (loaded once)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                from tokenspout.engine.tokenizer import load_tokenizer

                self._tokenizer = load_tokenizer(self.config.model.tokenizer or self.loaded.path)
            return self._tokenizer

    def add_request(self, req: EngineCoreRequest) -> None:
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"request id {req.request_id!r} is already running")
        seed = req.sampling_params.seed
        if seed is None:
            seed = secrets.randbits(63)  # unseeded: a fresh random stream per request
        if req.sampling_params.structured_outputs is not None:
            self.structured.get().submit(req.request_id, req.sampling_params.structured_outputs)
        request = Request(req, seed, self.max_model_len)
        if req.sampling_params.uses_guidance:
            guidance.make_companion(request, req, seed, self.max_model_len)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        """Requests to serve, or a step in flight whose results are still to be taken."""
        return self._in_flight is not None or self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        if self._stepper is None:
            sched = self.scheduler.schedule()
            result = self.runner.execute(sched)  # also releases rows of removed requests when empty
            outputs = self.scheduler.update_from_output(sched, result)
            if self.speculator is not None:
                self.speculator.propose_draft_token_ids(sched, result, self.scheduler.running,
                                                        bool(self.scheduler.waiting), self.kv.blocks_of)
                self.scheduler.update_draft_token_ids(self.speculator.take_draft_token_ids())
        else:
            outputs = self._step_async()
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.stats(),
                                 timestamp=time.monotonic(),
                                 request_timestamps=self.scheduler.take_request_timestamps())

    def _step_async(self) -> list[EngineCoreOutput]:
        """Async scheduling: schedules and prepares step N+1 while step N runs on the stepper thread, then takes
        step N's results.  Step N+1 assumes every request of step N that samples goes on; the ones that end
        there (a stop token) get one wasted token, dropped.  Batches that need step N's tokens on the host before
        step N+1 can be built (grammars, guidance companions, speculation) step synchronously."""
        if self._in_flight is None:
            self._in_flight = self._submit(self.scheduler.schedule())
        ahead = None
        if self._can_schedule_ahead():
            ahead = self._submit(self.scheduler.schedule())
        sched, future = self._in_flight
        self._in_flight = ahead
        return self.scheduler.update_from_output(sched, future.result())

    def _submit(self, sched: SchedulerOutput) -> tuple[SchedulerOutput, Future]:
        assert self._stepper is not None  # async scheduling
        step = self.runner.prepare(sched)
        return sched, self._stepper.submit(self.runner.run, step)

    def _can_schedule_ahead(self) -> bool:
        s = self.scheduler
        if not s.has_unfinished_requests() or self.structured.active() is not None:
            return False
        return not guidance.needs_sync_step(s.running) and not guidance.needs_sync_step(s.waiting)

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        return self.speculator.add_stats(stats) if self.speculator is not None else stats

    def shutdown(self) -> None:
        if self._stepper is not None:
            self._stepper.shutdown(wait=True)
        self.structured.shutdown()
