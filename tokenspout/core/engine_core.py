"""The engine core: scheduler + model runner, stepped while work exists.  The same object serves in-process
(offline LLM, tests) and inside EngineCoreProc behind ZMQ."""

from __future__ import annotations

import logging
import secrets
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tokenspout.config import EngineConfig
from tokenspout.core.kv_cache_manager import KVCacheManager
from tokenspout.core.request import Request
from tokenspout.core.scheduler import Scheduler, SchedulerOutput
from tokenspout.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from tokenspout.models.loader import LoadedModel, load_model
from tokenspout.spec_decode.draft_model import DraftProposer, draft_block_bytes, forward_params, load_draft_model
from tokenspout.spec_decode.ngram_proposer import NgramProposer
from tokenspout.spec_decode.policy import SpecPolicy, draft_cost
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
        spec = config.speculative
        draft = (load_draft_model(spec, self.loaded, config.model.quantization)
                 if spec.method == "draft" and spec.draft_model else None)
        extra = draft_block_bytes(draft, config.cache.block_size) if draft is not None else 0
        self.runner = ModelRunner(self.loaded, config.cache, config.scheduler, extra_block_bytes=extra)
        self.kv = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                 enable_prefix_caching=config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        self.proposer = (NgramProposer(spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max)
                         if spec.method == "ngram" else None)
        self.drafter = None
        cost = 0.0
        if spec.method == "draft":
            self.drafter = DraftProposer.build(self.runner, spec, draft)
            self.runner.drafter = self.drafter
            self.scheduler.num_lookahead_tokens = spec.num_speculative_tokens
            src = self.drafter.source
            cost = draft_cost(forward_params(src.model, src.num_layers), forward_params(self.loaded.model, None))
        small = self.runner.decoder.max_tokens if self.runner.decoder is not None else 0
        self.policy = SpecPolicy(spec, cost, free_drafts=self.proposer is not None, small_step_tokens=small)
        self.scheduler.on_spec_round = self.policy.record
        self._tokenizer = None  # the HF tokenizer, for grammars: loaded by warm_up() or the first grammar request
        # Async scheduling: one thread steps the model (the kernels release the GIL) while this one schedules;
        # speculative decoding drafts from the tokens of the step before, so it always steps synchronously.
        self._stepper: ThreadPoolExecutor | None = None
        self._in_flight: tuple[SchedulerOutput, Future] | None = None
        if config.scheduler.async_scheduling and spec.method is None:
            threads = torch.get_num_threads()  # a thread's OpenMP team size is its own: set it there too
            self._stepper = ThreadPoolExecutor(1, "engine-step", initializer=torch.set_num_threads,
                                               initargs=(threads,))

    def warm_up(self) -> None:
        """Loads what a first grammar request would otherwise wait for, while the engine is idle (EngineCoreProc
        calls it once, when idle after READY): the tokenizer and with it transformers (~1 s of imports that the
        start-up no longer pays) and the grammar manager's module.  Building the grammar backend stays lazy."""
        if self._tokenizer is None:
            from tokenspout.engine.tokenizer import load_tokenizer
            from tokenspout.structured_output import manager  # noqa: F401 - imported for its cost, now

            self._tokenizer = load_tokenizer(self.loaded.path)

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
        """Requests to serve, or a step in flight whose results are still to be taken."""
        return self._in_flight is not None or self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        if self._stepper is None:
            sched = self.scheduler.schedule()
            result = self.runner.execute(sched, self.kv)  # also releases rows of removed requests when empty
            outputs = self.scheduler.update_from_output(sched, result)
            if self.proposer is not None or self.drafter is not None:
                self._propose()
        else:
            outputs = self._step_async()
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.scheduler.stats(),
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
        step = self.runner.prepare(sched, self.kv)
        return sched, self._stepper.submit(self.runner.run, step)

    def _can_schedule_ahead(self) -> bool:
        s = self.scheduler
        if not s.has_unfinished_requests() or (s.structured is not None and s.structured.num_requests):
            return False
        return not any(r.companion is not None for r in s.running) and not any(
            r.companion is not None for r in s.waiting)

    def _structured(self):
        """The grammar manager, created on the first structured request (engines without one pay nothing)."""
        if self.scheduler.structured is None:
            from tokenspout.structured_output.manager import StructuredOutputManager

            self.warm_up()
            mgr = StructuredOutputManager(self._tokenizer, self.loaded.arch.vocab_size,
                                          max_num_rows=self.config.scheduler.max_num_seqs)
            self.scheduler.structured = mgr
            self.runner.structured = mgr
        return self.scheduler.structured

    def _propose(self) -> None:
        """Drafts for the next step of every decoding request that speculation may serve and that the policy
        lets draft: n-gram lookups per request, or one batched draft-model run for all of them."""
        running = self.scheduler.running
        batched = len(running) > 1
        wanting: list[tuple[Request, list[int] | None, int]] = []  # (request, n-gram drafts, room)
        rates: dict[int, float] = {}  # tokens per step expected of the requests that may draft (see below)
        for req in running:
            req.spec_token_ids = []
            if req.num_computed_tokens != req.num_tokens - 1 or not spec_eligible(req):
                continue
            room = min(self.config.speculative.num_speculative_tokens, req.max_len - req.num_tokens - 1)
            if room <= 0:
                continue
            if self.proposer is None and req.params.structured_outputs is not None:
                # A draft model's q knows no grammar: cutting its drafts at the first token the grammar refuses
                # (as n-gram drafts are cut below) would bias the rejection sampler, so grammar requests take
                # n-gram drafts only.
                continue
            wants = self.policy.wants_drafts(req, batched)
            if wants:
                rates[id(req)] = max(1.0, req.spec_ema)
            if self.proposer is not None:
                drafts = self.proposer.propose(req.token_ids)[:room]
                if drafts and req.params.structured_outputs is not None:
                    # A draft the grammar refuses would be rejected anyway, and so would all after it; the
                    # verify step masks each drafted position by the grammar advanced over the drafts before it.
                    # (Exact for n-gram drafts: q is a point mass, so any way of choosing them is.)
                    drafts = drafts[: self.scheduler.structured.validate_tokens(req.request_id, drafts)]
                if wants and drafts:
                    wanting.append((req, drafts, room))
                elif not wants:
                    self.policy.shadow(req, drafts)  # free evidence for when drafting would pay again
            elif wants:
                wanting.append((req, None, room))
        if batched and not self.scheduler.waiting:
            keep = self.policy.on_critical_path([r for r, _, _ in wanting], running, rates)
            for (req, drafts, _), k in zip(wanting, keep):
                if not k and drafts is not None:
                    self.policy.shadow(req, drafts)  # not drafting this step: keep the evidence coming
            wanting = [w for w, k in zip(wanting, keep) if k]
        cands = [(req, drafts, len(drafts) if drafts is not None else self.policy.num_drafts(req, room))
                 for req, drafts, room in wanting]
        for req, drafts, _ in cands:
            if drafts is not None:
                req.spec_shadow = None  # a real round replaces the pending shadow one
        counts = self.policy.fit_step([(r, n) for r, _, n in cands], len(running))
        drafting, num_drafts = [], []
        for (req, drafts, _), n in zip(cands, counts):
            if drafts is not None:
                req.spec_token_ids = drafts[:n]
            elif n:
                drafting.append(req)
                num_drafts.append(n)
        if drafting:  # one batched draft-model run for every request that drafts
            for req, drafts in zip(drafting, self.drafter.propose(drafting, num_drafts, self.kv)):
                req.spec_token_ids = drafts

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def shutdown(self) -> None:
        if self._stepper is not None:
            self._stepper.shutdown(wait=True)
        if self.scheduler.structured is not None:
            self.scheduler.structured.shutdown()
