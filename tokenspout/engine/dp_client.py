"""Data parallelism on one machine (`--data-parallel-size N`, vLLM's name): N engine-core processes, each with its
own model copy, KV cache and thread count, behind one frontend.  This client looks like one AsyncMPClient to
AsyncLLM: it routes each request to an engine, fans aborts out to the engines that own the requests, and merges the
engines' output streams.

Routing rule (per request, at add time):
1. a child of an `n > 1` request goes where its siblings went (they are added one after the other, ids
   f"{i}_{parent}"), so the choices share one prefix cache and one ParentRequest's lifetime; a CFG pair is one
   engine request already (the engine core makes the companion);
2. prefix affinity: the request's first AFFINITY_TOKENS prompt tokens hash to the engine that last took that
   prefix; it goes there unless that engine holds more than `min load + max(AFFINITY_SLACK, min load / 8)`
   requests, i.e. busier than the least loaded one by more than a prefill's saving is worth (a chat template's
   shared system prompt makes many requests share a key: the bound keeps them balanced within ~12%);
3. else the least loaded engine (in-flight requests this client has sent and not yet seen finish; ties: the lowest
   index), and the prefix is remembered for it.
Load is counted here, not read from the engines' stats: it is exact at the moment of the decision, while stats
arrive a step late.

Failure: an engine that dies ends its own requests with an error (the frontend fails exactly those, as it fails
all of them when a single engine dies); new requests go to the live engines; `dead_reason` says which engine died, so the
server's /health answers 503 (a supervisor should restart it) while the live engines finish what they hold.  When
no engine is left, get_output_async raises EngineDeadError like a single engine's death.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections import OrderedDict
from dataclasses import replace

import msgspec

from tokenspout.config import EngineConfig
from tokenspout.core.engine_core_proc import EngineReady
from tokenspout.engine.core_client import AsyncMPClient, wait_ready_async
from tokenspout.engine.exceptions import EngineDeadError
from tokenspout.engine.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats

logger = logging.getLogger(__name__)

AFFINITY_TOKENS = 64  # four 16-token blocks: enough to tell system prompts / few-shot preambles apart
AFFINITY_SLACK = 2
_AFFINITY_ENTRIES = 4096


def engine_configs(config: EngineConfig) -> list[EngineConfig]:
    """One config per engine: the cores divided among them unless --num-threads says otherwise."""
    n = config.data_parallel_size
    threads = config.num_threads or max(1, len(os.sched_getaffinity(0)) // n)
    return [replace(config, num_threads=threads, data_parallel_size=1) for _ in range(n)]


def _child_parent(request_id: str) -> tuple[int, str] | None:
    head, sep, rest = request_id.partition("_")
    return (int(head), rest) if sep and head.isdigit() else None


class EngineRouter:
    """The routing rule of the module docstring, on counts only (no processes: unit-testable)."""

    def __init__(self, num_engines: int) -> None:
        self.load = [0] * num_engines  # in flight per engine
        self.routed = [0] * num_engines  # requests sent per engine, ever
        self._affinity: OrderedDict[bytes, int] = OrderedDict()
        self._last_child: tuple[int, str, int] | None = None  # (index, parent id, engine) of the last child added

    def pick(self, request_id: str, prompt_token_ids: list[int], live: list[int]) -> int:
        """The engine for a new request among `live` (non-empty), counted as in flight there."""
        child = _child_parent(request_id)
        chosen = None
        if child is not None and self._last_child is not None:
            index, parent = child
            last_index, last_parent, engine = self._last_child
            if parent == last_parent and index == last_index + 1 and engine in live:
                chosen = engine
        if chosen is None:
            least = min(live, key=lambda k: (self.load[k], k))
            key = hashlib.blake2b(str(prompt_token_ids[:AFFINITY_TOKENS]).encode(), digest_size=8).digest()
            preferred = self._affinity.get(key)
            floor = self.load[least]
            if preferred is None or preferred not in live or \
                    self.load[preferred] > floor + max(AFFINITY_SLACK, floor // 8):
                chosen = least  # the prefix's engine is unknown, gone, or too busy for the saving to pay
            else:
                chosen = preferred
            self._affinity[key] = chosen
            self._affinity.move_to_end(key)
            while len(self._affinity) > _AFFINITY_ENTRIES:
                self._affinity.popitem(last=False)
        self._last_child = (child[0], child[1], chosen) if child is not None else None
        self.load[chosen] += 1
        self.routed[chosen] += 1
        return chosen

    def finished(self, engine: int) -> None:
        self.load[engine] -= 1

    def engine_lost(self, engine: int) -> None:
        self.load[engine] = 0


class DPAsyncMPClient:
    def __init__(self, config: EngineConfig, wait: bool = True, **kw) -> None:
        self.configs = engine_configs(config)
        self.engines = [AsyncMPClient(c, wait=False, hang_timeout_s=c.engine_hang_timeout_s, **kw)
                        for c in self.configs]
        self.router = EngineRouter(len(self.engines))
        self.owner: dict[str, int] = {}
        self.dead: set[int] = set()  # engines found dead, whose requests were ended with an error
        self.stats: list[SchedulerStats | None] = [None] * len(self.engines)
        self._pending: dict[int, asyncio.Task] = {}
        self._failed: list[tuple[list[str], str]] = []
        self.info: EngineReady | None = None
        if wait:
            self.wait_ready()

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def wait_ready(self, on_wait=None) -> EngineReady:
        infos = [e.wait_ready(on_wait) for e in self.engines]
        # One KV cache per engine: report the total, so capacity figures stay true.
        self.info = msgspec.structs.replace(infos[0], num_kv_blocks=sum(i.num_kv_blocks for i in infos))
        return self.info

    def _down(self) -> list[int]:
        return [k for k, e in enumerate(self.engines) if k in self.dead or (e.info is not None and not e.is_alive)]

    @property
    def health_problem(self) -> str | None:
        """Why /health answers 503 (some engine died) while the others may still serve; None when all are up."""
        down = self._down()
        if not down:
            return None
        reasons = "; ".join(f"engine {k}: {self.engines[k].dead_reason or 'process exited'}" for k in down)
        return f"{len(down)} of {len(self.engines)} engines died ({reasons})"

    @property
    def dead_reason(self) -> str | None:
        """Set only when no engine is left (then the whole frontend is dead, as with one engine)."""
        return self.health_problem if len(self._down()) == len(self.engines) else None

    @property
    def is_alive(self) -> bool:
        return len(self._down()) < len(self.engines)

    async def restart_dead(self) -> int:
        """Replaces each engine whose death was handled (its requests failed) by a new process and waits for it to
        load; the others serve meanwhile.  Returns how many were restarted."""
        restarted = 0
        for k in sorted(self.dead):
            task = self._pending.pop(k, None)
            if task is not None:
                task.cancel()
            self.engines[k].shutdown()  # dead already: returns at once
            new = AsyncMPClient(self.configs[k], wait=False, hang_timeout_s=self.configs[k].engine_hang_timeout_s)
            try:
                await wait_ready_async(new)
            except BaseException:
                new.shutdown()
                raise
            self.engines[k] = new
            self.stats[k] = None
            self.dead.discard(k)
            restarted += 1
        return restarted

    def kill(self) -> None:
        for e in self.engines:
            e.kill()

    def shutdown(self) -> None:
        for task in self._pending.values():
            task.cancel()
        for e in self.engines:
            e.shutdown()

    # -- routing ------------------------------------------------------------------------------------------------
    def _live(self) -> list[int]:
        live = [k for k in range(len(self.engines)) if k not in self._down()]
        if not live:
            raise EngineDeadError(self.dead_reason or "every engine is dead")
        return live

    def add_request(self, req: EngineCoreRequest) -> None:
        k = self.router.pick(req.request_id, req.prompt_token_ids, self._live())
        self.owner[req.request_id] = k
        self.engines[k].add_request(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        # The frontend has finished these requests already (the engine may never answer for them): they stop
        # counting as in flight now.
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            k = self.owner.pop(rid, None)
            if k is not None:
                self.router.finished(k)
                if k not in self.dead:
                    by_engine.setdefault(k, []).append(rid)
        for k, ids in by_engine.items():
            self.engines[k].abort_requests(ids)

    # -- outputs -------------------------------------------------------------------------------------------------
    async def get_output_async(self) -> EngineCoreOutputs:
        """The next batch from any engine; its scheduler_stats are the engines' totals."""
        while True:
            # `dead`: engines whose requests were failed.  One whose process is gone is found by its pending
            # task, which raises EngineDeadError within a poll interval.
            live = [k for k in range(len(self.engines)) if k not in self.dead]
            for k in live:
                if k not in self._pending:
                    self._pending[k] = asyncio.ensure_future(self.engines[k].get_output_async())
            done, _ = await asyncio.wait([self._pending[k] for k in live], return_when=asyncio.FIRST_COMPLETED)
            k = next(k for k in live if self._pending[k] in done)
            task = self._pending.pop(k)
            try:
                outs = task.result()
            except EngineDeadError:
                return self._engine_died(k)
            if outs.engine_error is not None:
                return self._engine_died(k, outs)
            return self._account(k, outs)

    def _account(self, k: int, outs: EngineCoreOutputs) -> EngineCoreOutputs:
        for o in outs.outputs:
            if o.finish_reason is not None and self.owner.pop(o.request_id, None) is not None:
                self.router.finished(k)
        if outs.scheduler_stats is not None:
            self.stats[k] = outs.scheduler_stats
            outs.scheduler_stats = self.total_stats()
        return outs

    def _engine_died(self, k: int, outs: EngineCoreOutputs | None = None) -> EngineCoreOutputs:
        """Engine k is gone: its requests are handed to `take_failed` (the frontend ends each with an error),
        and the batch returned holds nothing of them."""
        self.dead.add(k)
        if len(self.dead) == len(self.engines):  # nothing left: the frontend's engine-death path takes over
            raise EngineDeadError(self.dead_reason or "every engine is dead")
        reason = f"engine {k} of {len(self.engines)} died: " + (
            self.engines[k].dead_reason or (outs.engine_error if outs else None) or "process exited")
        logger.error("%s; its requests end with an error, the other engines keep serving", reason)
        mine = {rid for rid, owner in self.owner.items() if owner == k}
        for rid in mine:
            del self.owner[rid]
        self.router.engine_lost(k)
        self.stats[k] = None
        self._failed.append((sorted(mine), reason))
        return EngineCoreOutputs(scheduler_stats=self.total_stats(), timestamp=outs.timestamp if outs else 0.0)

    def take_failed(self) -> list[tuple[list[str], str]]:
        """(engine request ids, reason) of the engines that died since the last call."""
        failed, self._failed = self._failed, []
        return failed

    def engine_snapshots(self) -> list[dict[str, float]]:
        down = set(self._down())
        out = []
        for k, st in enumerate(self.stats):
            snap: dict[str, float] = {"up": 0.0 if k in down else 1.0, "routed": float(self.router.routed[k])}
            if st is not None and k not in down:
                snap.update(num_running=st.num_running, num_waiting=st.num_waiting, kv_cache_usage=st.kv_cache_usage)
            out.append(snap)
        return out

    def total_stats(self) -> SchedulerStats:
        live = [s for s in self.stats if s is not None]
        total = SchedulerStats()
        for field in SchedulerStats.__struct_fields__:
            setattr(total, field, sum(getattr(s, field) for s in live))
        blocks = sum(s.num_total_blocks for s in live)
        total.kv_cache_usage = (sum(s.kv_cache_usage * s.num_total_blocks for s in live) / blocks) if blocks else 0.0
        return total
