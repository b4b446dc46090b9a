"""The engine core: scheduler + model runner, stepped while work exists.  The same object serves in-process
(offline LLM, tests) and inside EngineCoreProc behind ZMQ."""

from __future__ import annotations

import logging
import secrets
import time

import torch

from tokenspout.config import EngineConfig
from tokenspout.core.kv_cache_manager import KVCacheManager
from tokenspout.core.request import Request
from tokenspout.core.scheduler import Scheduler
from tokenspout.engine.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from tokenspout.models.loader import LoadedModel, load_model
from tokenspout.spec_decode.ngram_proposer import NgramProposer
from tokenspout.worker.model_runner import ModelRunner
from tokenspout.worker.spec_verify import spec_eligible

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        config.validate()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.loaded = loaded or load_model(config.model)
        self.max_model_len = self.loaded.max_model_len
        self.runner = ModelRunner(self.loaded, config.cache, config.scheduler)
        self.kv = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                 enable_prefix_caching=config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        spec = config.speculative
        self.proposer = (NgramProposer(spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max)
                         if spec.method == "ngram" else None)

    def add_request(self, req: EngineCoreRequest) -> None:
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"request id {req.request_id!r} is already running")
        seed = req.sampling_params.seed
        if seed is None:
            seed = secrets.randbits(63)  # unseeded: a fresh random stream per request
        if req.sampling_params.structured_outputs is not None:
            self._structured().submit(req.request_id, req.sampling_params.structured_outputs)
        request = Request(req, seed, self.max_model_len)
        if req.sampling_params.uses_guidance:
            neg = req.sampling_params.negative_prompt_token_ids
            if not neg:
                raise ValueError("guidance_scale needs negative_prompt_token_ids (the frontend fills them)")
            companion = Request(EngineCoreRequest(f"{req.request_id}#cfg", list(neg), req.sampling_params,
                                                  req.arrival_time), seed, self.max_model_len)
            companion.is_companion = True
            request.companion = companion
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        sched = self.scheduler.schedule()
        result = self.runner.execute(sched, self.kv)  # also releases rows of removed requests when empty
        outputs = self.scheduler.update_from_output(sched, result)
        if self.proposer is not None:
            self._propose()
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.scheduler.stats(),
                                 timestamp=time.monotonic())

    def _structured(self):
        """The grammar manager, created on the first structured request (engines without one pay nothing)."""
        if self.scheduler.structured is None:
            from tokenspout.engine.tokenizer import load_tokenizer
            from tokenspout.structured_output.manager import StructuredOutputManager

            tok = load_tokenizer(self.loaded.path)
            mgr = StructuredOutputManager(tok, self.loaded.arch.vocab_size,
                                          max_num_rows=self.config.scheduler.max_num_seqs)
            self.scheduler.structured = mgr
            self.runner.structured = mgr
        return self.scheduler.structured

    def _propose(self) -> None:
        """Drafts for the next step of every decoding request that speculation may serve (n-gram lookup)."""
        spec = self.config.speculative
        # In a batch a verification costs relatively more (drafted rows take the per-request attention path and
        # add GEMM rows to a step that is no longer weight-bound), so it must emit more to pay (bench/speculative).
        need = spec.min_mean_emitted if len(self.scheduler.running) <= 1 else spec.min_mean_emitted_batched
        for req in self.scheduler.running:
            req.spec_token_ids = []
            if req.num_computed_tokens != req.num_tokens - 1 or not spec_eligible(req):
                continue
            if req.num_output_tokens < req.spec_pause_until:
                continue
            if (req.spec_rounds >= spec.min_rounds
                    and req.spec_accepted + req.spec_rounds < need * req.spec_rounds):
                # Drafts do not pay for this request right now: pause, doubling the pause each time it fails
                # again (text often turns repetitive later, e.g. after a preamble, so never give up for good).
                req.spec_backoff = min(2 * req.spec_backoff or 16, 256)
                req.spec_pause_until = req.num_output_tokens + req.spec_backoff
                req.spec_rounds = req.spec_accepted = 0
                continue
            room = min(spec.num_speculative_tokens, req.max_len - req.num_tokens - 1)
            if room > 0:
                drafts = self.proposer.propose(req.token_ids)[:room]
                if drafts and req.params.structured_outputs is not None:
                    # A draft the grammar refuses would be rejected anyway, and so would all after it; the
                    # verify step masks each drafted position by the grammar advanced over the drafts before it.
                    drafts = drafts[: self.scheduler.structured.validate_tokens(req.request_id, drafts)]
                req.spec_token_ids = drafts

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def shutdown(self) -> None:
        if self.scheduler.structured is not None:
            self.scheduler.structured.shutdown()
