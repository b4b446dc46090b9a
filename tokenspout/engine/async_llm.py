"""AsyncLLM: the asyncio frontend of the API server.

One background task (the output handler) drains the engine's socket, runs the OutputProcessor over each batch of
outputs in chunks (yielding to the event loop between chunks so streaming responses keep flowing) and routes
RequestOutputs to per-request collectors.  `generate()` is an async iterator over one request's collector; when its
consumer stops early (client disconnect, cancellation) the request is aborted in the engine.

Supervision (`start_supervision`, called by the server at start-up): a task that watches the engine process(es).
A dead engine (its process exited, or crashed in a step) or a hung one (silent for --engine-hang-timeout: see
core_client) fails its in-flight requests, then is restarted: a new process loads the model again while new
requests get 503 + Retry-After; `restarts` counts them (/metrics).  With engine_restart False
(--no-engine-restart) the server is told to exit non-zero instead, as vLLM does.  With data parallelism one dead
engine is restarted alone while the others serve.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable

from tokenspout.config import EngineConfig
from tokenspout.engine.core_client import AsyncMPClient, wait_ready_async
from tokenspout.engine.dp_client import DPAsyncMPClient
from tokenspout.engine.exceptions import EngineDeadError
from tokenspout.engine.messages import SchedulerStats
from tokenspout.engine.output_processor import OutputProcessor, RequestOutputCollector
from tokenspout.engine.processor import Processor, read_generation_config, sampling_defaults
from tokenspout.engine.tokenizer import load_tokenizer
from tokenspout.offload import Offloader
from tokenspout.outputs import RequestOutput
from tokenspout.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_CHUNK = 128  # outputs processed between two yields to the event loop
_SUPERVISE_S = 0.25  # how often the supervisor looks at the engine(s)
_START_ATTEMPTS = 3  # restarts tried in a row before giving up (a model that no longer loads)


def make_async_client(config: EngineConfig) -> AsyncMPClient | DPAsyncMPClient:
    """The engine process(es) for `config`, started and not waited for (the caller loads its tokenizer meanwhile)."""
    if config.data_parallel_size > 1:
        return DPAsyncMPClient(config, wait=False)
    return AsyncMPClient(config, wait=False, hang_timeout_s=config.engine_hang_timeout_s)


class AsyncLLM:
    def __init__(self, config: EngineConfig, on_wait=None, client: AsyncMPClient | DPAsyncMPClient | None = None):
        """client: the engine process, already started for this config (AsyncMPClient(config, wait=False))."""
        self.config = config
        # The engine process starts first (unless the caller started it): it loads the model while this process
        # loads the tokenizer.
        self.client = client or make_async_client(config)
        try:
            self.tokenizer = load_tokenizer(config.model.tokenizer_folder())
            info = self.client.wait_ready(on_wait)
        except BaseException:
            self.client.shutdown()
            raise
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.num_kv_blocks = info.num_kv_blocks
        self.processor = Processor(self.tokenizer, info.max_model_len, info.vocab_size,
                                   generation_config=read_generation_config(config.model.folder()),
                                   chat_template=config.model.chat_template)
        # Sampling defaults for the fields a request omits (the server applies them; empty with generation_config
        # "vllm" or when the model folder sets none).
        self.default_sampling_params = (
            sampling_defaults(read_generation_config(config.model.model))
            if config.model.generation_config == "auto" else {})
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=True)
        self.scheduler_stats = SchedulerStats(num_total_blocks=info.num_kv_blocks,
                                              num_free_blocks=info.num_kv_blocks)
        self.stats_listeners: list = []  # callables(AsyncLLM) run after each batch of outputs (metrics)
        self.last_batch_num_tokens = 0  # tokens of the last batch of outputs (prompts done + generated), for them
        self._handler: asyncio.Task | None = None
        self._supervisor: asyncio.Task | None = None
        self.restarts = 0  # engine processes restarted after dying or hanging
        self.restarting = False
        self._fatal: str | None = None  # set when the engine is dead for good (no restart)
        self._dead: str | None = None
        self._prep = Offloader("tokenspout-process")  # tokenization and validation off the event loop

    # ---- the contract the server uses --------------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        return self._dead is not None or not self.client.is_alive

    @property
    def recovering(self) -> bool:
        """The engine is dead or restarting but will serve again: requests get 503 + Retry-After, not 500."""
        return self.restarting or (self.errored and self.config.engine_restart and self._fatal is None
                                   and self._supervisor is not None and not self._supervisor.done())

    def start_supervision(self, on_fatal: Callable[[str], None] | None = None) -> None:
        """Starts the output handler now (so heartbeats are read while idle) and the supervisor task (module
        docstring).  `on_fatal(reason)`: called once when the engine is dead for good (--no-engine-restart, or a
        restart that failed): the server exits non-zero."""
        self._ensure_handler()
        if self._supervisor is None or self._supervisor.done():
            self._supervisor = asyncio.get_running_loop().create_task(self._supervise(on_fatal), name="supervisor")

    @property
    def dead_reason(self) -> str | None:
        if self._dead is None and not self.client.is_alive:
            self._dead = self.client.dead_reason or "engine process is not running"
        return self._dead

    async def check_health(self) -> None:
        if self.errored:
            raise EngineDeadError(self.dead_reason or "engine is dead")
        problem = getattr(self.client, "health_problem", None)  # data parallel: some engine died, others serve
        if problem:
            raise EngineDeadError(problem)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kw) -> str:
        return self.processor.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kw)

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str, *,
                       add_special_tokens: bool | None = None) -> AsyncGenerator[RequestOutput, None]:
        """add_special_tokens None: the prompt's rule (False for a ChatPrompt from apply_chat_template, whose
        template already wrote BOS; the tokenizer's rule for plain text)."""
        if self.errored:
            raise EngineDeadError(self.dead_reason or "engine is dead")
        self._ensure_handler()
        queue = RequestOutputCollector(sampling_params.output_kind)
        processed = await self._prep.run(self.processor.process, request_id, prompt, sampling_params, time.time(),
                                         add_special_tokens=add_special_tokens)
        self.output_processor.add_processed(processed, self.client, queue)
        finished = False
        try:
            while not finished:
                out = queue.get_nowait() or await queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                # Consumer went away (disconnect, cancel, aclose) or an error: stop the engine's work now.
                self._abort_now(request_id)

    async def abort(self, request_id: str) -> None:
        self._abort_now(request_id)

    def get_metrics_snapshot(self) -> dict[str, float]:
        """Engine-side gauges and totals for /metrics (request-level metrics are recorded by the serving layer)."""
        st = self.scheduler_stats
        return {"num_running": st.num_running, "num_waiting": st.num_waiting, "kv_cache_usage": st.kv_cache_usage,
                "num_preemptions": st.num_preemptions, "spec_num_drafts": st.spec_num_drafts,
                "spec_num_draft_tokens": st.spec_num_draft_tokens,
                "spec_num_accepted_tokens": st.spec_num_accepted_tokens,
                "spec_num_emitted_tokens": st.spec_num_emitted_tokens,
                "prefix_cache_queries": st.prefix_cache_queries, "prefix_cache_hits": st.prefix_cache_hits,
                "num_wasted_tokens": self.output_processor.stats.num_wasted_tokens,
                "engine_restarts": self.restarts}

    def get_engine_snapshots(self) -> list[dict[str, float]]:
        """Per-engine gauges with --data-parallel-size > 1 (empty with one engine: the totals say it all)."""
        snapshots = getattr(self.client, "engine_snapshots", None)
        return snapshots() if snapshots is not None else []

    def get_cache_config_info(self) -> dict[str, str]:
        """The KV-cache configuration as vLLM's `cache_config_info` labels.  The KV blocks live in CPU memory here,
        but they are the blocks vLLM's CPU backend also reports as num_gpu_blocks (num_cpu_blocks is swap: none)."""
        cache = self.config.cache
        return {"block_size": str(cache.block_size), "cache_dtype": cache.kv_cache_dtype,
                "enable_prefix_caching": str(cache.enable_prefix_caching), "num_gpu_blocks": str(self.num_kv_blocks),
                "num_cpu_blocks": "0"}

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def kill(self) -> None:
        """Exit at once (a second SIGTERM): the engine processes are killed, not asked to stop."""
        self.client.kill()

    def shutdown(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
        if self._handler is not None:
            self._handler.cancel()
        self._prep.shutdown()
        self.client.shutdown()

    # ---- supervision ---------------------------------------------------------------------------------------
    async def _supervise(self, on_fatal: Callable[[str], None] | None) -> None:
        while True:
            await asyncio.sleep(_SUPERVISE_S)
            partial = None if self.errored else getattr(self.client, "health_problem", None)
            if not self.errored and not partial:
                self._ensure_handler()
                continue
            reason = self.dead_reason or partial or "engine is dead"
            if self.config.engine_restart:
                try:
                    if partial:  # data parallel: the dead engines alone, the others keep serving
                        restarted = await self.client.restart_dead()  # type: ignore[union-attr]
                    else:
                        await self._restart(reason)
                        restarted = 1
                    if restarted:
                        self.restarts += restarted
                        logger.warning("engine restarted (%d so far) after: %s", self.restarts, reason)
                    continue
                except Exception as e:  # noqa: BLE001 - a model that no longer loads: dead for good
                    reason = f"{reason}; restart failed: {e}"
            self._fatal = reason
            logger.error("engine is dead and not restarted: %s", reason)
            if on_fatal is not None:
                on_fatal(reason)
            return

    async def _restart(self, reason: str) -> None:
        """Replaces the whole engine client: a new process (or set of them) loads the model; in-flight requests end
        with an error first."""
        self.restarting = True
        try:
            if self._handler is not None:
                self._handler.cancel()
                # Waits for it to end without taking on its outcome; a cancellation of this task (the server
                # shutting down) still propagates, so no new engine is started after it.
                await asyncio.wait([self._handler])
            self.output_processor.propagate_error(reason)  # no-op for requests the handler failed already
            self.client.shutdown()  # dead (or killed as hung): returns at once
            for attempt in range(_START_ATTEMPTS):
                client = make_async_client(self.config)
                try:
                    await wait_ready_async(client)
                    break
                except BaseException as e:  # also cancelled (server shutdown): never leave the new process behind
                    client.shutdown()
                    if not isinstance(e, RuntimeError) or attempt + 1 == _START_ATTEMPTS:
                        raise
                    await asyncio.sleep(2.0 ** attempt)
            self.client = client
            self.scheduler_stats = SchedulerStats(num_total_blocks=self.num_kv_blocks,
                                                  num_free_blocks=self.num_kv_blocks)
            self._dead = None
            self._ensure_handler()
        finally:
            self.restarting = False

    # ---- internals -----------------------------------------------------------------------------------------
    def _abort_now(self, request_id: str) -> None:
        engine_ids = self.output_processor.abort_requests([request_id])
        if engine_ids and not self.errored:
            self.client.abort_requests(engine_ids)

    def _ensure_handler(self) -> None:
        if self._handler is None or self._handler.done():
            self._handler = asyncio.get_running_loop().create_task(self._output_handler(), name="output-handler")

    async def _output_handler(self) -> None:
        try:
            while True:
                outs = await self.client.get_output_async()
                if not outs.outputs and outs.scheduler_stats is None and outs.engine_error is None:
                    continue  # a heartbeat (the client noted it)
                for request_ids, reason in getattr(self.client, "take_failed", list)():
                    self.output_processor.propagate_error(reason, set(request_ids))  # one DP engine died
                items = outs.outputs
                num_tokens = 0
                times = {t.request_id: t for t in outs.request_timestamps} if outs.request_timestamps else None
                for start in range(0, len(items), _CHUNK):
                    processed = self.output_processor.process_outputs(items[start : start + _CHUNK],
                                                                      outs.timestamp, times)
                    num_tokens += processed.num_tokens
                    if processed.reqs_to_abort:
                        self.client.abort_requests(processed.reqs_to_abort)
                    if start + _CHUNK < len(items):
                        await asyncio.sleep(0)
                self.last_batch_num_tokens = num_tokens
                if outs.scheduler_stats is not None:
                    self.scheduler_stats = outs.scheduler_stats
                for listener in self.stats_listeners:
                    listener(self)
                if outs.engine_error is not None:
                    raise EngineDeadError(f"engine core failed: {outs.engine_error}")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever killed the engine, every request must learn of it
            self._dead = str(e) or type(e).__name__
            logger.error("engine is dead, failing all in-flight requests: %s", self._dead)
            self.output_processor.propagate_error(self._dead)
