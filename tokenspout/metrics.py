"""Prometheus metrics of the server, on a registry of their own (no process-global state).

Names, types, label names and buckets follow vLLM's v1 metrics (vllm/v1/metrics/loggers.py) under a prefix,
`tokenspout:` by default: with `prefix="vllm"` every family is `vllm:...`, so a vLLM Grafana dashboard reads this server
unchanged.  vLLM's `engine` label is left out of those families: they are the totals over the engines (dashboards
select on `model_name`); with --data-parallel-size the `engine_*` families carry `engine="k"` per engine.

Who records what:
- Request-level metrics (finished requests by finish reason, prompt/generation tokens, TTFT, inter-token latency,
  end-to-end latency, per-request token counts, n and max_tokens, queue / prefill / decode / inference time) are
  recorded by the OpenAI serving layer from the outputs it hands to the client, so they are exact from the user's
  point of view.  Non-streamed requests (FINAL_ONLY) only yield once: their TTFT is the frontend's first-token
  latency carried on the final output (RequestMetrics), and they have no inter-token latency.  Queue / prefill /
  decode / inference times come from engine-core timestamps carried on the final output too.  If the engine
  frontend records request-level metrics itself, build the app with `record_request_metrics=False` to avoid
  counting twice.
- Engine-level metrics (running / waiting requests, KV-cache usage, preemptions, tokens generated past a stop string,
  speculative decoding, prefix caching) are pushed by the engine frontend through the `set_*` / `add_*` / `observe_*`
  methods, or pulled at scrape time from `AsyncLLM.get_metrics_snapshot()` via `update_from_snapshot`; tokens per
  engine step (`iteration_tokens_total`) are observed after each batch of engine outputs, and `cache_config_info` is
  set once from `AsyncLLM.get_cache_config_info()`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from prometheus_client import CONTENT_TYPE_LATEST as PROMETHEUS_CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokenspout.outputs import RequestMetrics

__all__ = ["DEFAULT_PREFIX", "PROMETHEUS_CONTENT_TYPE", "FinishedChoice", "RequestTimer", "ServerMetrics",
           "build_1_2_5_buckets", "check_prefix"]

DEFAULT_PREFIX = "tokenspout"
_PREFIX_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_DEFAULT_MAX_MODEL_LEN = 8192  # token-count buckets when the model's context length is not known

# vLLM's buckets.  TTFT, inter-token and end-to-end latency keep tokenspout's finer low buckets as well (a superset
# only adds resolution to the same quantile queries).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                     40.0, 80.0)
_ITL_BUCKETS = tuple(sorted({0.001, 0.0025, 0.005, 0.015, 0.02, 0.03, 0.04, *_VLLM_ITL_BUCKETS}))
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                            240.0, 480.0, 960.0, 1920.0, 7680.0)
_E2E_BUCKETS = tuple(sorted({0.1, 300.0, *_REQUEST_LATENCY_BUCKETS}))
_ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's buckets for token counts)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


def check_prefix(prefix: str) -> str:
    """The metric name prefix (without the colon), validated: a Prometheus name start, no colon."""
    if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"metrics_prefix must match [a-zA-Z_][a-zA-Z0-9_]* (it becomes '<prefix>:'), got {prefix!r}")
    return prefix


class FinishedChoice(NamedTuple):
    """One finished choice (engine request) of a prompt, as the serving layer saw it."""

    finish_reason: str
    generation_tokens: int
    metrics: RequestMetrics | None = None


class ServerMetrics:
    def __init__(self, model_name: str = "", registry: CollectorRegistry | None = None, *,
                 prefix: str = DEFAULT_PREFIX, max_model_len: int | None = None) -> None:
        """`prefix`: every family is named `<prefix>:<vLLM's name>` ("vllm" for vLLM's own dashboards).
        `max_model_len`: the top of the token-count histograms' 1-2-5 buckets (vLLM's choice)."""
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.prefix = check_prefix(prefix)
        r, m, p = self.registry, ["model_name"], self.prefix + ":"
        token_buckets = build_1_2_5_buckets(max_model_len or _DEFAULT_MAX_MODEL_LEN)

        def hist(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(p + name, doc, m, buckets=buckets, registry=r)

        # --- request level (serving layer) ---
        self._requests = Counter(p + "request_success", "Finished sequences (choices) by finish reason.",
                                 m + ["finished_reason"], registry=r)
        self._prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens processed.", m, registry=r)
        self._generation_tokens = Counter(p + "generation_tokens", "Tokens generated.", m, registry=r)
        self._ttft = hist("time_to_first_token_seconds", "Time to first token in seconds.", _TTFT_BUCKETS)
        self._itl = hist("inter_token_latency_seconds", "Time between consecutive streamed outputs in seconds.",
                         _ITL_BUCKETS)
        # vLLM's older name for the same samples (deprecated there, still on many dashboards).
        self._tpot = hist("time_per_output_token_seconds",
                          "Time per output token in seconds (same samples as inter_token_latency_seconds).",
                          _VLLM_ITL_BUCKETS)
        self._e2e = hist("e2e_request_latency_seconds", "Arrival to last output of a request in seconds.",
                         _E2E_BUCKETS)
        self._req_prompt = hist("request_prompt_tokens", "Prompt tokens of finished requests.", token_buckets)
        self._req_generation = hist("request_generation_tokens", "Tokens generated by finished requests.",
                                    token_buckets)
        self._req_max_gen = hist("request_max_num_generation_tokens",
                                 "Most tokens generated by one choice of a request (n choices).", token_buckets)
        self._req_n = hist("request_params_n", "The n request parameter.", _N_BUCKETS)
        self._req_max_tokens = hist("request_params_max_tokens", "The max_tokens request parameter (effective).",
                                    token_buckets)
        self._queue = hist("request_queue_time_seconds",
                           "Time in the engine's WAITING queue before first scheduled, in seconds.",
                           _REQUEST_LATENCY_BUCKETS)
        self._inference = hist("request_inference_time_seconds",
                               "First scheduled to last token (RUNNING phase), in seconds.", _REQUEST_LATENCY_BUCKETS)
        self._prefill = hist("request_prefill_time_seconds", "First scheduled to first token (PREFILL), in seconds.",
                             _REQUEST_LATENCY_BUCKETS)
        self._decode = hist("request_decode_time_seconds", "First token to last token (DECODE), in seconds.",
                            _REQUEST_LATENCY_BUCKETS)
        self._req_tpot = hist("request_time_per_output_token_seconds",
                              "Mean time per output token of a request after its first, in seconds.",
                              _VLLM_ITL_BUCKETS)

        # --- engine level (engine frontend, pushed or pulled from a snapshot) ---
        self._running = Gauge(p + "num_requests_running", "Requests in the running batch.", m, registry=r)
        self._waiting = Gauge(p + "num_requests_waiting", "Requests waiting to be scheduled.", m, registry=r)
        self._kv_usage = Gauge(p + "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", m,
                               registry=r)
        self._gpu_kv_usage = Gauge(p + "gpu_cache_usage_perc",
                                   "Fraction of KV-cache blocks in use (0..1); vLLM's older name of "
                                   "kv_cache_usage_perc (the cache lives in CPU memory here).", m, registry=r)
        self._preemptions = Counter(p + "num_preemptions", "Requests preempted by the scheduler.", m, registry=r)
        self._restarts = Counter(p + "engine_restarts", "Engine-core processes restarted after dying or hanging.", m,
                                 registry=r)
        self._wasted = Counter(p + "wasted_tokens", "Tokens generated past a stop string (computed, never returned).",
                               m, registry=r)
        self._iteration_tokens = hist("iteration_tokens_total", "Tokens per engine step (batch of outputs).",
                                      _ITERATION_TOKENS_BUCKETS)
        self._cache_info: Gauge | None = None  # labels known once the engine is up: set_cache_config_info
        self._cache_info_names: set[str] = set()

        # --- speculative decoding (engine frontend; zero while no proposer is configured) ---
        self._spec_drafts = Counter(p + "spec_decode_num_drafts", "Draft proposals verified.", m, registry=r)
        self._spec_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens proposed.", m,
                                          registry=r)
        self._spec_accepted = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", m,
                                      registry=r)
        self._spec_emitted = Counter(p + "spec_decode_num_emitted_tokens",
                                     "Tokens emitted by verification rounds (accepted drafts + 1 each).", m,
                                     registry=r)
        self._spec_mean_len = Gauge(p + "spec_decode_mean_acceptance_length",
                                    "Mean tokens emitted per verification round since start.", m, registry=r)

        # --- prefix caching (tokens; hits / queries is the hit rate) ---
        self._prefix_queries = Counter(p + "prefix_cache_queries",
                                       "Tokens looked up in the prefix cache when sequences were scheduled.", m,
                                       registry=r)
        self._prefix_hits = Counter(p + "prefix_cache_hits", "Looked-up tokens found in the prefix cache.", m,
                                    registry=r)

        # --- per data-parallel engine (--data-parallel-size; the families above are the engines' totals) ---
        e = ["model_name", "engine"]
        self._engine_running = Gauge(p + "engine_num_requests_running", "Requests running in one engine.", e,
                                     registry=r)
        self._engine_waiting = Gauge(p + "engine_num_requests_waiting", "Requests waiting in one engine.", e,
                                     registry=r)
        self._engine_kv = Gauge(p + "engine_kv_cache_usage_perc", "Fraction of one engine's KV blocks in use.", e,
                                registry=r)
        self._engine_up = Gauge(p + "engine_up", "1 while the engine's process serves, 0 once it died.", e,
                                registry=r)
        self._engine_routed = Gauge(p + "engine_requests_routed", "Engine requests routed to the engine so far.", e,
                                    registry=r)

        # Bind the model label once: `labels()` is a locked dict lookup, too slow for a per-token path.  Binding also
        # exports every series from the start (at 0), not only after its first event.
        self._bound = {
            id(metric): metric.labels(model_name=model_name)
            for metric in (self._prompt_tokens, self._generation_tokens, self._ttft, self._itl, self._tpot, self._e2e,
                           self._req_prompt, self._req_generation, self._req_max_gen, self._req_n,
                           self._req_max_tokens, self._queue, self._inference, self._prefill, self._decode,
                           self._req_tpot, self._running, self._waiting, self._kv_usage, self._gpu_kv_usage,
                           self._preemptions, self._wasted, self._iteration_tokens,
                           self._spec_drafts, self._spec_draft_tokens, self._spec_accepted, self._spec_emitted,
                           self._spec_mean_len, self._prefix_queries, self._prefix_hits, self._restarts)
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
        self._l(self._tpot).observe(seconds)

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

    def observe_finished_choices(self, prompt_tokens: int, choices: Sequence[FinishedChoice]) -> None:
        """The per-request histograms of one prompt's finished choices.  As in vLLM, token counts, max_tokens and
        phase times count each choice (an engine request), n and the most tokens of a choice count the prompt once.
        Phase times are left out for choices aborted or failed (they never ran to an end)."""
        if not choices:
            return
        req_prompt, req_gen = self._l(self._req_prompt), self._l(self._req_generation)
        for c in choices:
            req_prompt.observe(prompt_tokens)
            req_gen.observe(c.generation_tokens)
            m = c.metrics
            if m is None:
                continue
            if m.max_tokens_param:
                self._l(self._req_max_tokens).observe(m.max_tokens_param)
            # The phases are known together (once the request produced a token) or not at all.
            prefill, decode, inference = m.prefill_time, m.decode_time, m.inference_time
            if c.finish_reason in ("abort", "error") or prefill is None or decode is None or inference is None:
                continue
            if m.queued_time is not None:
                self._l(self._queue).observe(m.queued_time)
            self._l(self._prefill).observe(prefill)
            self._l(self._decode).observe(decode)
            self._l(self._inference).observe(inference)
            if c.generation_tokens > 1:
                self._l(self._req_tpot).observe(decode / (c.generation_tokens - 1))
        self._l(self._req_n).observe(len(choices))
        self._l(self._req_max_gen).observe(max(c.generation_tokens for c in choices))

    # ------------------------------------------------------------------ engine level
    def set_scheduler_stats(self, running: int, waiting: int, kv_usage: float) -> None:
        self._l(self._running).set(running)
        self._l(self._waiting).set(waiting)
        self._l(self._kv_usage).set(kv_usage)
        self._l(self._gpu_kv_usage).set(kv_usage)

    def add_preemptions(self, n: int) -> None:
        self._l(self._preemptions).inc(n)

    def add_wasted_tokens(self, n: int) -> None:
        self._l(self._wasted).inc(n)

    def observe_iteration_tokens(self, n: int) -> None:
        """Tokens of one engine step (a batch of outputs); steps without tokens (stats only) are not steps."""
        if n > 0:
            self._l(self._iteration_tokens).observe(n)

    def set_cache_config_info(self, info: Mapping[str, str]) -> None:
        """vLLM's `cache_config_info`: a gauge at 1 whose labels are the KV-cache configuration (set once: the label
        names are fixed when the gauge is made; a later call with other names is ignored)."""
        labels = {k: str(v) for k, v in info.items()}
        if self._cache_info is None:
            self._cache_info_names = set(labels)
            self._cache_info = Gauge(self.prefix + ":cache_config_info", "Information of the KV-cache config.",
                                     sorted(labels), registry=self.registry)
        elif self._cache_info_names != set(labels):
            return
        self._cache_info.clear()
        self._cache_info.labels(**labels).set(1)

    def attach_engine(self, engine: object) -> Callable[[], None]:
        """Feeds the engine-pushed families from an engine frontend that offers them (AsyncLLM; duck-typed, others
        are left alone): `cache_config_info` now, `iteration_tokens_total` after each batch of outputs.  Returns
        the function that detaches it."""
        info = getattr(engine, "get_cache_config_info", None)
        if info is not None:
            self.set_cache_config_info(info())
        listeners = getattr(engine, "stats_listeners", None)
        if not isinstance(listeners, list):
            return lambda: None

        def on_batch(e: object) -> None:
            self.observe_iteration_tokens(getattr(e, "last_batch_num_tokens", 0))

        listeners.append(on_batch)
        return lambda: listeners.remove(on_batch) if on_batch in listeners else None

    def observe_spec_decode(self, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self._l(self._spec_drafts).inc(num_drafts)
        self._l(self._spec_draft_tokens).inc(num_draft_tokens)
        self._l(self._spec_accepted).inc(num_accepted_tokens)

    def update_from_snapshot(self, snapshot: Mapping[str, float]) -> None:
        """Applies `AsyncLLM.get_metrics_snapshot()`.  Known keys (all optional, unknown keys ignored):
        gauges `num_running`, `num_waiting`, `kv_cache_usage`; cumulative totals `num_preemptions`,
        `num_wasted_tokens`, `spec_num_drafts`, `spec_num_draft_tokens`, `spec_num_accepted_tokens`,
        `spec_num_emitted_tokens`, `prefix_cache_queries`, `prefix_cache_hits`, `engine_restarts`."""
        if "num_running" in snapshot:
            self._l(self._running).set(snapshot["num_running"])
        if "num_waiting" in snapshot:
            self._l(self._waiting).set(snapshot["num_waiting"])
        if "kv_cache_usage" in snapshot:
            self._l(self._kv_usage).set(snapshot["kv_cache_usage"])
            self._l(self._gpu_kv_usage).set(snapshot["kv_cache_usage"])
        for key, counter in (
            ("num_preemptions", self._preemptions),
            ("num_wasted_tokens", self._wasted),
            ("spec_num_drafts", self._spec_drafts),
            ("spec_num_draft_tokens", self._spec_draft_tokens),
            ("spec_num_accepted_tokens", self._spec_accepted),
            ("spec_num_emitted_tokens", self._spec_emitted),
            ("prefix_cache_queries", self._prefix_queries),
            ("prefix_cache_hits", self._prefix_hits),
            ("engine_restarts", self._restarts),
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

    def update_engines(self, engines: Sequence[Mapping[str, float]]) -> None:
        """Per-engine gauges from `AsyncLLM.get_engine_snapshots()` (data parallel only): keys `up`,
        `num_running`, `num_waiting`, `kv_cache_usage`, `routed`, labelled engine="k"."""
        for k, snap in enumerate(engines):
            labels = {"model_name": self.model_name, "engine": str(k)}
            for key, gauge in (("up", self._engine_up), ("num_running", self._engine_running),
                               ("num_waiting", self._engine_waiting), ("kv_cache_usage", self._engine_kv),
                               ("routed", self._engine_routed)):
                if key in snap:
                    gauge.labels(**labels).set(snap[key])

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Times one engine request as its outputs reach the client: TTFT at the first output carrying tokens,
    then the gap between consecutive outputs that carry tokens (inter-token latency).  Outputs that are not timed
    (non-streamed) leave TTFT to the engine frontend's first-token latency, given at `finish`."""

    __slots__ = ("finished", "last", "metrics", "start", "timed_first")

    def __init__(self, metrics: ServerMetrics | None) -> None:
        self.metrics = metrics
        self.start = time.perf_counter()
        self.last: float | None = None
        self.finished = False
        self.timed_first = False

    def on_tokens(self, timed: bool = True) -> None:
        now = time.perf_counter()
        if self.metrics is not None and timed:
            if self.last is None:
                self.metrics.observe_first_token(now - self.start)
                self.timed_first = True
            else:
                self.metrics.observe_inter_token(now - self.last)
        self.last = now

    def finish(self, finish_reasons: list[str], prompt_tokens: int, generation_tokens: int,
               choices: Sequence[FinishedChoice] = ()) -> None:
        """`choices`: the finished choices with their engine metrics (per-request histograms, and TTFT when the
        outputs were not timed here)."""
        if self.finished:  # a request ends exactly once, however the stream ends
            return
        self.finished = True
        if self.metrics is None:
            return
        end = self.last if self.last is not None else time.perf_counter()
        if not self.timed_first:
            firsts = [c.metrics.first_token_latency for c in choices
                      if c.metrics is not None and c.metrics.first_token_latency is not None]
            if firsts:
                self.metrics.observe_first_token(min(firsts))  # the prompt's first token, whichever choice
        self.metrics.observe_request_finished(finish_reasons, prompt_tokens, generation_tokens, end - self.start)
        self.metrics.observe_finished_choices(prompt_tokens, choices)
