"""Prometheus metrics of the server, on a registry of their own (no process-global state).

Who records what:
- Request-level metrics (finished requests by finish reason, prompt/generation tokens, TTFT, inter-token latency,
  end-to-end latency) are recorded by the OpenAI serving layer from the outputs it hands to the client, so they
  are exact from the user's point of view.  Non-streamed requests (FINAL_ONLY) only yield once, so they feed the
  counters and the end-to-end histogram but not TTFT / inter-token latency.  If the engine frontend records
  request-level metrics itself, build the app with `record_request_metrics=False` to avoid counting twice.
- Engine-level metrics (running / waiting requests, KV-cache usage, preemptions, tokens generated past a stop string,
  speculative decoding, prefix caching) are pushed by the engine frontend through the `set_*` / `add_*` / `observe_spec_decode`
  methods, or pulled at scrape time from `AsyncLLM.get_metrics_snapshot()` via `update_from_snapshot`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from prometheus_client import CONTENT_TYPE_LATEST as PROMETHEUS_CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["PROMETHEUS_CONTENT_TYPE", "RequestTimer", "ServerMetrics"]

_PREFIX = "tokenspout:"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    def __init__(self, model_name: str = "", registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r, m = self.registry, ["model_name"]

        # --- request level (serving layer) ---
        self._requests = Counter(
            _PREFIX + "request_success", "Finished sequences (choices) by finish reason.", m + ["finished_reason"],
            registry=r,
        )
        self._prompt_tokens = Counter(_PREFIX + "prompt_tokens", "Prompt tokens processed.", m, registry=r)
        self._generation_tokens = Counter(_PREFIX + "generation_tokens", "Tokens generated.", m, registry=r)
        self._ttft = Histogram(
            _PREFIX + "time_to_first_token_seconds", "Time to first token (streamed requests).", m,
            buckets=_TTFT_BUCKETS, registry=r,
        )
        self._itl = Histogram(
            _PREFIX + "inter_token_latency_seconds", "Time between consecutive streamed outputs.", m,
            buckets=_ITL_BUCKETS, registry=r,
        )
        self._e2e = Histogram(
            _PREFIX + "e2e_request_latency_seconds", "Arrival to last output of a request.", m,
            buckets=_E2E_BUCKETS, registry=r,
        )

        # --- engine level (engine frontend, pushed or pulled from a snapshot) ---
        self._running = Gauge(_PREFIX + "num_requests_running", "Requests in the running batch.", m, registry=r)
        self._waiting = Gauge(_PREFIX + "num_requests_waiting", "Requests waiting to be scheduled.", m, registry=r)
        self._kv_usage = Gauge(_PREFIX + "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", m,
                               registry=r)
        self._preemptions = Counter(_PREFIX + "num_preemptions", "Requests preempted by the scheduler.", m,
                                    registry=r)
        self._wasted = Counter(
            _PREFIX + "wasted_tokens", "Tokens generated past a stop string (computed, never returned).", m,
            registry=r,
        )

        # --- speculative decoding (engine frontend; zero while no proposer is configured) ---
        self._spec_drafts = Counter(_PREFIX + "spec_decode_num_drafts", "Draft proposals verified.", m, registry=r)
        self._spec_draft_tokens = Counter(_PREFIX + "spec_decode_num_draft_tokens", "Draft tokens proposed.", m,
                                          registry=r)
        self._spec_accepted = Counter(_PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", m,
                                      registry=r)
        self._spec_emitted = Counter(_PREFIX + "spec_decode_num_emitted_tokens",
                                     "Tokens emitted by verification rounds (accepted drafts + 1 each).", m,
                                     registry=r)
        self._spec_mean_len = Gauge(_PREFIX + "spec_decode_mean_acceptance_length",
                                    "Mean tokens emitted per verification round since start.", m, registry=r)

        # --- prefix caching (tokens; hits / queries is the hit rate) ---
        self._prefix_queries = Counter(_PREFIX + "prefix_cache_queries",
                                       "Tokens looked up in the prefix cache when sequences were scheduled.", m,
                                       registry=r)
        self._prefix_hits = Counter(_PREFIX + "prefix_cache_hits", "Looked-up tokens found in the prefix cache.", m,
                                    registry=r)

        # Bind the model label once: `labels()` is a locked dict lookup, too slow for a per-token path.  Binding also
        # exports every series from the start (at 0), not only after its first event.
        self._bound = {
            id(metric): metric.labels(model_name=model_name)
            for metric in (self._prompt_tokens, self._generation_tokens, self._ttft, self._itl, self._e2e,
                           self._running, self._waiting, self._kv_usage, self._preemptions, self._wasted,
                           self._spec_drafts, self._spec_draft_tokens, self._spec_accepted, self._spec_emitted,
                           self._spec_mean_len, self._prefix_queries, self._prefix_hits)
        }
        self._by_reason = {r: self._requests.labels(model_name=model_name, finished_reason=r)
                           for r in ("stop", "length", "abort", "error")}

        # Snapshots carry cumulative totals; Prometheus counters only go up, so remember what was already added.
        self._snapshot_totals: dict[str, float] = {}

    def _l(self, metric):  # the metric's child for this model
        return self._bound[id(metric)]

    # ------------------------------------------------------------------ request level
    def observe_first_token(self, seconds: float) -> None:
        self._l(self._ttft).observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self._l(self._itl).observe(seconds)

    def observe_request_finished(
        self, finish_reasons: list[str], prompt_tokens: int, generation_tokens: int, e2e_seconds: float | None = None
    ) -> None:
        """One engine request (one prompt) ended; `finish_reasons` has one entry per choice."""
        for reason in finish_reasons:
            child = self._by_reason.get(reason)
            if child is None:
                child = self._by_reason[reason] = self._requests.labels(model_name=self.model_name,
                                                                        finished_reason=reason)
            child.inc()
        self._l(self._prompt_tokens).inc(prompt_tokens)
        self._l(self._generation_tokens).inc(generation_tokens)
        if e2e_seconds is not None:
            self._l(self._e2e).observe(e2e_seconds)

    # ------------------------------------------------------------------ engine level
    def set_scheduler_stats(self, running: int, waiting: int, kv_usage: float) -> None:
        self._l(self._running).set(running)
        self._l(self._waiting).set(waiting)
        self._l(self._kv_usage).set(kv_usage)

    def add_preemptions(self, n: int) -> None:
        self._l(self._preemptions).inc(n)

    def add_wasted_tokens(self, n: int) -> None:
        self._l(self._wasted).inc(n)

    def observe_spec_decode(self, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self._l(self._spec_drafts).inc(num_drafts)
        self._l(self._spec_draft_tokens).inc(num_draft_tokens)
        self._l(self._spec_accepted).inc(num_accepted_tokens)

    def update_from_snapshot(self, snapshot: Mapping[str, float]) -> None:
        """Applies `AsyncLLM.get_metrics_snapshot()`.  Known keys (all optional, unknown keys ignored):
        gauges `num_running`, `num_waiting`, `kv_cache_usage`; cumulative totals `num_preemptions`,
        `num_wasted_tokens`, `spec_num_drafts`, `spec_num_draft_tokens`, `spec_num_accepted_tokens`,
        `spec_num_emitted_tokens`, `prefix_cache_queries`, `prefix_cache_hits`."""
        if "num_running" in snapshot:
            self._l(self._running).set(snapshot["num_running"])
        if "num_waiting" in snapshot:
            self._l(self._waiting).set(snapshot["num_waiting"])
        if "kv_cache_usage" in snapshot:
            self._l(self._kv_usage).set(snapshot["kv_cache_usage"])
        for key, counter in (
            ("num_preemptions", self._preemptions),
            ("num_wasted_tokens", self._wasted),
            ("spec_num_drafts", self._spec_drafts),
            ("spec_num_draft_tokens", self._spec_draft_tokens),
            ("spec_num_accepted_tokens", self._spec_accepted),
            ("spec_num_emitted_tokens", self._spec_emitted),
            ("prefix_cache_queries", self._prefix_queries),
            ("prefix_cache_hits", self._prefix_hits),
        ):
            if key in snapshot:
                total = float(snapshot[key])
                delta = total - self._snapshot_totals.get(key, 0.0)
                if delta > 0:  # a restarted engine resets its totals: never decrease a counter
                    self._l(counter).inc(delta)
                self._snapshot_totals[key] = total
        drafts = self._snapshot_totals.get("spec_num_drafts", 0.0)
        if drafts > 0:
            self._l(self._spec_mean_len).set(self._snapshot_totals.get("spec_num_emitted_tokens", 0.0) / drafts)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Times one engine request as its outputs reach the client: TTFT at the first output carrying tokens,
    then the gap between consecutive outputs that carry tokens (inter-token latency)."""

    __slots__ = ("finished", "last", "metrics", "start")

    def __init__(self, metrics: ServerMetrics | None) -> None:
        self.metrics = metrics
        self.start = time.perf_counter()
        self.last: float | None = None
        self.finished = False

    def on_tokens(self, timed: bool = True) -> None:
        now = time.perf_counter()
        if self.metrics is not None and timed:
            if self.last is None:
                self.metrics.observe_first_token(now - self.start)
            else:
                self.metrics.observe_inter_token(now - self.last)
        self.last = now

    def finish(self, finish_reasons: list[str], prompt_tokens: int, generation_tokens: int) -> None:
        if self.finished:  # a request ends exactly once, however the stream ends
            return
        self.finished = True
        if self.metrics is not None:
            end = self.last if self.last is not None else time.perf_counter()
            self.metrics.observe_request_finished(finish_reasons, prompt_tokens, generation_tokens, end - self.start)
