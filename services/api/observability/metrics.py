"""Prometheus metrics of the api process: vLLM V1's series, named `kvserve:` for `vllm:`.

The series of vLLM's PrometheusStatLogger that kvserve can honour (tests/support/vllm_metrics.py
lists vLLM 0.32's, with the reason for each of the others), with the same labels:
`model_name` and `engine` (the engine core's index, "0" without data parallelism), and
`finished_reason` on `request_success`. So a vLLM Grafana board works once its queries say
`kvserve:` (docs/grafana/kvserve.json is such a board), or at once under
`--metrics-prefix vllm`, which serves vLLM's names (services/api/observability/metric_names.py).
Sources:

- scrape time (`_EngineStatsCollector`): each engine's latest load (running, waiting, KV
  usage), the sums of its per-step counters (preemptions, prefix cache), `cache_config_info`
  from its READY message, and the kvserve-only `kvserve:engine_up`;
- each engine step (`ApiMetrics.record`, called by the EngineClient): tokens, TTFT,
  inter-token latency, and for each finished request its lengths, parameters and phase times
  (services/api/observability/stats.py says which clock each comes from);
- structured outputs (kvserve's own series): requests waiting for their grammar, grammar
  cache queries and hits, and each grammar's compile time;
- per tenant (services/api/tenancy/metrics.py): tokens and requests as the responses' `usage`
  counts them, queue time, TTFT, running and waiting requests; the same ended requests feed
  the usage ledger of GET /v1/usage (services/api/tenancy/usage.py);
- latency targets (services/api/observability/slo_metrics.py): targets met and missed, in
  all and by tenant, the goodput gauge, and each engine's step time prediction error;
- prompt pins (services/api/observability/pin_metrics.py): pinned blocks, pin hits and misses
  by TTL class, expirations, pins yielded;
- the KV store's disk tier (services/api/observability/store_disk_metrics.py): bytes and
  files held, blocks written, read and evicted, checksum failures, as the store counts them;
- LoRA (with --enable-lora): vLLM's `lora_requests_info`, the adapters of running and
  waiting requests in its labels, at scrape time;
- prometheus_client's process, platform and GC collectors (`process_*`, `python_*`).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from kvserve.services.api.observability.metric_names import vllm_named
from kvserve.services.api.observability.pin_metrics import PinStatsCollector
from kvserve.services.api.observability.slo_metrics import SloMetrics
from kvserve.services.api.observability.stats import (
    MIGRATION_REASONS,
    RESUME_BUCKETS,
    IterationStats,
    MigrationStats,
)
from kvserve.services.api.observability.store_disk_metrics import DISK_GAUGES
from kvserve.services.api.tenancy.metrics import TenantMetrics
from kvserve.services.api.tenancy.usage import UsageLedger
from kvserve.shared.messages import FinishReason, SchedulerStats

LABELS = ["model_name", "engine"]

# vLLM's buckets, in seconds.
# fmt: off
_TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]
_ITL_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]
_REQUEST_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]
# fmt: on
_ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
_COMPILE_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
_N_BUCKETS = [1, 2, 5, 10, 20]
_PREEMPTION_BUCKETS = [1, 2, 3, 4, 5, 10, 20]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


# The per-request latency series (`_request_series`' second half): fixed buckets.
_LATENCY_SERIES: dict[str, tuple[str, list | None]] = {
    "time_to_first_token_seconds": (
        "Histogram of time to first token in seconds.",
        _TTFT_BUCKETS,
    ),
    "inter_token_latency_seconds": (
        "Histogram of inter-token latency in seconds.",
        _ITL_BUCKETS,
    ),
    "time_per_output_token_seconds": (
        "Histogram of time per output token in seconds. "
        "DEPRECATED: Use kvserve:inter_token_latency_seconds instead.",
        _ITL_BUCKETS,
    ),
    "request_time_per_output_token_seconds": (
        "Histogram of time_per_output_token_seconds per request.",
        _ITL_BUCKETS,
    ),
    "e2e_request_latency_seconds": (
        "Histogram of e2e request latency in seconds.",
        _REQUEST_BUCKETS,
    ),
    "request_queue_time_seconds": (
        "Histogram of time spent in WAITING phase for request.",
        _REQUEST_BUCKETS,
    ),
    "request_inference_time_seconds": (
        "Histogram of time spent in RUNNING phase for request.",
        _REQUEST_BUCKETS,
    ),
    "request_prefill_time_seconds": (
        "Histogram of time spent in PREFILL phase for request.",
        _REQUEST_BUCKETS,
    ),
    "request_decode_time_seconds": (
        "Histogram of time spent in DECODE phase for request.",
        _REQUEST_BUCKETS,
    ),
    "structured_output_compile_time_seconds": (
        "Histogram of the time to compile a request's grammar (JSON schema, regex, ...).",
        _COMPILE_BUCKETS,
    ),
    "kv_transfer_seconds": (
        "Histogram of the time of one batch of KV blocks moved to or from the KV store.",
        _COMPILE_BUCKETS,
    ),
}


def _request_series(max_model_len: int) -> dict[str, tuple[str, list | None]]:
    """name -> (documentation, buckets, None for a counter) of each series `record` updates:
    the token counts (bucketed up to max_model_len), then the latencies."""
    return {**_token_series(build_1_2_5_buckets(max_model_len)), **_LATENCY_SERIES}


def _token_series(tokens: list[int]) -> dict[str, tuple[str, list | None]]:
    """The token-count series; `tokens`: the buckets of a per-request token count."""
    return {
        "prompt_tokens": ("Number of prefill tokens processed.", None),
        "generation_tokens": ("Number of generation tokens processed.", None),
        "prompt_tokens_cached": ("Number of cached prompt tokens (local + external).", None),
        "iteration_tokens_total": (
            "Histogram of number of tokens per engine_step.",
            _ITERATION_TOKEN_BUCKETS,
        ),
        "request_prompt_tokens": ("Number of prefill tokens processed.", tokens),
        "request_generation_tokens": ("Number of generation tokens processed.", tokens),
        "request_max_num_generation_tokens": (
            "Histogram of maximum number of requested generation tokens.",
            tokens,
        ),
        "request_params_n": ("Histogram of the n request parameter.", _N_BUCKETS),
        "request_num_preemptions": (
            "Histogram of the number of times a request was preempted.",
            _PREEMPTION_BUCKETS,
        ),
        "request_prefill_kv_computed_tokens": (
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            tokens,
        ),
        "request_params_max_tokens": ("Histogram of the max_tokens request parameter.", tokens),
    }


_GAUGES = (
    (
        "kvserve:num_requests_running",
        "Number of requests in model execution batches.",
        lambda stats: stats.num_running_reqs,
    ),
    (
        "kvserve:num_requests_waiting",
        "Number of requests waiting to be processed.",
        lambda stats: stats.num_waiting_reqs,
    ),
    (
        "kvserve:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        lambda stats: stats.kv_cache_usage,
    ),
    (
        "kvserve:num_requests_waiting_for_grammar",
        "Number of requests waiting for their grammar to compile (also counted as waiting).",
        lambda stats: stats.num_waiting_for_grammar,
    ),
    (
        "kvserve:kv_store_up",
        "1 while the KV connector's store answers, 0 while the engine recomputes instead "
        "(absent without a connector: -1).",
        lambda stats: -1 if stats.kv_store_up is None else int(stats.kv_store_up),
    ),
    (
        "kvserve:kv_store_usage_perc",
        "Fraction of the KV store's --size in use, as this engine last read it.",
        lambda stats: stats.kv_store_usage,
    ),
    (
        "kvserve:kv_store_hits",
        "Blocks the KV store served to lookups and gets since it started (all engines).",
        lambda stats: stats.kv_store_hits,
    ),
    (
        "kvserve:kv_store_misses",
        "Blocks asked of the KV store that it did not hold, since it started (all engines).",
        lambda stats: stats.kv_store_misses,
    ),
    *DISK_GAUGES,
)
_COUNTERS = (
    (
        "kvserve:num_preemptions",
        "Cumulative number of preemption from the engine.",
        lambda totals: totals.num_preemptions,
    ),
    (
        "kvserve:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        lambda totals: totals.prefix_cache_queries,
    ),
    (
        "kvserve:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        lambda totals: totals.prefix_cache_hits,
    ),
    (
        "kvserve:structured_output_cache_queries",
        "Structured-output requests that looked their grammar up in the cache.",
        lambda totals: totals.grammar_cache_queries,
    ),
    (
        "kvserve:structured_output_cache_hits",
        "Of those, requests whose grammar was cached (compiled or compiling).",
        lambda totals: totals.grammar_cache_hits,
    ),
    (
        "kvserve:external_prefix_cache_queries",
        "External prefix cache queries from KV connector cross-instance cache sharing, in "
        "terms of number of queried tokens.",
        lambda totals: totals.external_prefix_cache_queries,
    ),
    (
        "kvserve:external_prefix_cache_hits",
        "External prefix cache hits from KV connector cross-instance cache sharing, in "
        "terms of number of cached tokens.",
        lambda totals: totals.external_prefix_cache_hits,
    ),
    (
        "kvserve:kv_transfer_bytes_loaded",
        "Bytes of KV blocks this engine loaded from the KV store.",
        lambda totals: totals.kv_bytes_loaded,
    ),
    (
        "kvserve:kv_transfer_bytes_saved",
        "Bytes of KV blocks this engine saved to the KV store.",
        lambda totals: totals.kv_bytes_saved,
    ),
    (
        "kvserve:spec_decode_num_drafts",
        "Number of spec decoding drafts (requests that verified drafts, per step).",
        lambda totals: totals.spec_num_drafts,
    ),
    (
        "kvserve:spec_decode_num_draft_tokens",
        "Number of draft tokens.",
        lambda totals: totals.spec_num_draft_tokens,
    ),
    (
        "kvserve:spec_decode_num_accepted_tokens",
        "Number of accepted tokens.",
        lambda totals: totals.spec_num_accepted_tokens,
    ),
)


# vLLM's sleep_state labels, by sleep level (0: awake).
_SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


class _EngineStatsCollector:
    """Reads each engine's latest load, counter sums and cache config whenever /metrics is
    scraped."""

    def __init__(self, engine_client, model_name: str, max_loras: int | None = None):
        self.engine_client = engine_client
        self.model_name = model_name
        self.max_loras = max_loras

    def collect(self):
        per_engine = self.engine_client.per_engine_stats()
        for name, doc, read in _GAUGES:
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            for engine_index, stats, _ in per_engine:
                family.add_metric(self._labels(engine_index), read(stats) if stats else 0)
            yield family
        for name, doc, read in _COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=LABELS)
            for engine_index, _, totals in per_engine:
                counter.add_metric(self._labels(engine_index), read(totals))
            yield counter
        counter = CounterMetricFamily(
            "kvserve:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*LABELS, "position"],
        )
        for engine_index, _, totals in per_engine:
            for pos, count in enumerate(totals.spec_accepted_per_pos):
                counter.add_metric([*self._labels(engine_index), str(pos)], count)
        yield counter
        states = {
            entry["engine"]: entry["state"]
            for entry in self.engine_client.health_report()["engines"]
        }
        family = GaugeMetricFamily(
            "kvserve:engine_up", "1 while the engine core serves, 0 once it is gone.", labels=LABELS
        )
        for engine_index, _, _ in per_engine:
            family.add_metric(self._labels(engine_index), float(states.get(engine_index) != "dead"))
        yield family
        family = GaugeMetricFamily(
            "kvserve:engine_suspect",
            "1 while the engine core is silent past the heartbeat timeout (it gets no new "
            "requests, keeps its running ones) and not yet declared hung.",
            labels=LABELS,
        )
        for engine_index, _, _ in per_engine:
            family.add_metric(
                self._labels(engine_index), float(states.get(engine_index) == "suspect")
            )
        yield family
        yield self._sleep_state(per_engine)
        yield from self._migrations(per_engine)
        yield from self._cache_config_info()
        yield from self._gemm_path_info()
        if self.max_loras is not None:
            yield self._lora_requests_info(per_engine)

    def _sleep_state(self, per_engine) -> GaugeMetricFamily:
        """--enable-sleep-mode, as vLLM's engine_sleep_state: 1 on the engine's state among
        awake, weights_offloaded (level 1) and discard_all (level 2), 0 on the others."""
        family = GaugeMetricFamily(
            "kvserve:engine_sleep_state",
            "Engine sleep state: awake = 1 while it serves; weights_offloaded = 1 asleep at "
            "level 1, discard_all = 1 asleep at level 2.",
            labels=[*LABELS, "sleep_state"],
        )
        level = self.engine_client.sleep_level
        for engine_index, _, _ in per_engine:
            for state_level, state in enumerate(_SLEEP_STATES):
                family.add_metric([*self._labels(engine_index), state], float(level == state_level))
        return family

    def _migrations(self, per_engine):
        """The requests that moved off each engine core when it died (engine: the one that
        died), those that could not, and the time to their resumed streams."""
        all_stats = self.engine_client.migration_stats()
        moved = CounterMetricFamily(
            "kvserve:request_migrations",
            "Requests moved to a live engine core after theirs died, by why it died.",
            labels=[*LABELS, "reason"],
        )
        failed = CounterMetricFamily(
            "kvserve:request_migrations_failed",
            "Requests of a dead engine core that could not move: quarantined (past "
            "--max-request-migrations) or no engine core within --migration-wait-s.",
            labels=[*LABELS, "cause"],
        )
        resume = HistogramMetricFamily(
            "kvserve:request_migration_resume_seconds",
            "Seconds from an engine core's death to a moved request's first output on its "
            "new engine core.",
            labels=LABELS,
        )
        for engine_index, _, _ in per_engine:
            labels = self._labels(engine_index)
            stats = all_stats.get(engine_index) or MigrationStats()
            for reason in MIGRATION_REASONS:
                moved.add_metric([*labels, reason], stats.moves.get(reason, 0))
            failed.add_metric([*labels, "quarantined"], stats.quarantined)
            failed.add_metric([*labels, "no_engine"], stats.failed)
            buckets = [
                (str(bound), count)
                for bound, count in zip(RESUME_BUCKETS, stats.resume_bucket_counts)
            ]
            resume.add_metric(labels, [*buckets, ("+Inf", stats.resume_count)], stats.resume_sum_s)
        yield from (moved, failed, resume)

    def _labels(self, engine_index: int) -> list[str]:
        return [self.model_name, str(engine_index)]

    def _lora_requests_info(self, per_engine) -> GaugeMetricFamily:
        # vLLM's info gauge: the adapter names (over every engine) in comma-separated labels,
        # its value the time they were read.
        running: set[str] = set()
        waiting: set[str] = set()
        for _, stats, _ in per_engine:
            if stats is not None:
                running.update(stats.running_lora_adapters)
                waiting.update(stats.waiting_lora_adapters)
        family = GaugeMetricFamily(
            "kvserve:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        family.add_metric(
            [str(self.max_loras), ",".join(sorted(waiting)), ",".join(sorted(running))],
            time.time(),
        )
        return family

    def _cache_config_info(self):
        # An info metric as vLLM emulates one: a gauge at 1, the facts in its labels.
        handshakes = self.engine_client.engine_handshakes()
        if not handshakes:
            return
        keys = sorted({key for ready in handshakes for key in ready.cache_config_info})
        family = GaugeMetricFamily(
            "kvserve:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["engine", *keys],
        )
        for ready in handshakes:
            info = ready.cache_config_info
            family.add_metric([str(ready.engine_index), *(info.get(k, "") for k in keys)], 1)
        yield family

    def _gemm_path_info(self):
        # What each engine's start-up measured: one series per (engine, layer shape).
        family = GaugeMetricFamily(
            "kvserve:gemm_path_info",
            "CPU GEMM path of each linear layer shape, chosen by measuring at start-up",
            labels=["engine", "shape", "path"],
        )
        for ready in self.engine_client.engine_handshakes():
            for shape, path in sorted(ready.gemm_plan.items()):
                family.add_metric([str(ready.engine_index), shape, path], 1)
        yield family


class ApiMetrics:
    """The api's metrics, in a registry of their own (several apps may share a process).

    It subscribes to the engine client's step figures (`engine_client.stat_loggers`).

    Args:
        engine_client: the EngineClient whose engines and requests the series show.
        model_name: the served model name (the `model_name` label).
        max_loras: --max-loras with --enable-lora (adds lora_requests_info), else None.
        metrics_prefix: --metrics-prefix: "vllm" serves the series vLLM also has under vLLM's
            names and labels (services/api/observability/metric_names.py).

    Attributes:
        usage: the per-tenant usage ledger GET /v1/usage reads.
    """

    def __init__(
        self,
        engine_client,
        model_name: str,
        max_loras: int | None = None,
        metrics_prefix: str = "kvserve",
    ):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._exposed = self.registry if metrics_prefix == "kvserve" else vllm_named(self.registry)
        self.registry.register(_EngineStatsCollector(engine_client, model_name, max_loras))
        self.registry.register(PinStatsCollector(engine_client, model_name))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)

        # Parent series by name without the prefix; `_engine_series` holds their children.
        self._series: dict[str, Counter | Histogram] = {}
        for name, (doc, buckets) in _request_series(engine_client.max_model_len).items():
            series: Counter | Histogram
            if buckets is None:
                series = Counter(f"kvserve:{name}", doc, LABELS, registry=self.registry)
            else:
                series = Histogram(
                    f"kvserve:{name}", doc, LABELS, buckets=buckets, registry=self.registry
                )
            self._series[name] = series
        self.request_success = Counter(
            "kvserve:request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=self.registry,
        )
        self.tenants = TenantMetrics(self.registry, engine_client, _TTFT_BUCKETS, _REQUEST_BUCKETS)
        self.slo = SloMetrics(self.registry, engine_client, model_name, self.tenants.tenant_of)
        self.usage = UsageLedger()
        self._per_engine: dict[int, SimpleNamespace] = {}
        # Every known engine's series exist from the start, at zero, as vLLM's do.
        for engine_index, _, _ in engine_client.per_engine_stats():
            self._engine_series(engine_index)
        engine_client.stat_loggers.append(self)

    def _engine_series(self, engine_index: int) -> SimpleNamespace:
        """One engine's labelled children, looked up once."""
        series = self._per_engine.get(engine_index)
        if series is None:
            labels = (self.model_name, str(engine_index))
            series = SimpleNamespace(
                **{attr: parent.labels(*labels) for attr, parent in self._series.items()},
                request_success={
                    str(reason): self.request_success.labels(*labels, str(reason))
                    for reason in FinishReason
                },
            )
            self._per_engine[engine_index] = series
        return series

    def series(self, name: str) -> Counter | Histogram:
        """A per-step series by its name without the prefix ("time_to_first_token_seconds"),
        all engines' children under it (the status page reads them: dashboard_sampler.py)."""
        return self._series[name]

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self._exposed), CONTENT_TYPE_LATEST

    def record(
        self,
        engine_index: int,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats,
    ) -> None:
        """Take one engine step's figures."""
        self.tenants.record(iteration_stats)
        self.slo.record(engine_index, iteration_stats)
        self.usage.record(engine_index, scheduler_stats, iteration_stats)
        s = self._engine_series(engine_index)
        if scheduler_stats is not None:
            if scheduler_stats.num_scheduled_tokens > 0:
                s.iteration_tokens_total.observe(scheduler_stats.num_scheduled_tokens)
            for seconds in scheduler_stats.grammar_compile_times:
                s.structured_output_compile_time_seconds.observe(seconds)
            for seconds in scheduler_stats.kv_transfer_seconds:
                s.kv_transfer_seconds.observe(seconds)
        s.prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        s.generation_tokens.inc(iteration_stats.num_generation_tokens)
        s.prompt_tokens_cached.inc(iteration_stats.num_cached_prompt_tokens)
        for ttft in iteration_stats.time_to_first_tokens:
            s.time_to_first_token_seconds.observe(ttft)
        for itl in iteration_stats.inter_token_latencies:
            s.inter_token_latency_seconds.observe(itl)
            s.time_per_output_token_seconds.observe(itl)  # vLLM keeps both names
        for n in iteration_stats.n_params:
            s.request_params_n.observe(n)
        for num_tokens in iteration_stats.max_num_generation_tokens:
            s.request_max_num_generation_tokens.observe(num_tokens)
        if iteration_stats.num_aborted:
            s.request_success[str(FinishReason.ABORT)].inc(iteration_stats.num_aborted)
        for finished in iteration_stats.finished_requests:
            s.request_success[finished.finish_reason].inc()
            s.e2e_request_latency_seconds.observe(finished.e2e_latency)
            s.request_prompt_tokens.observe(finished.num_prompt_tokens)
            s.request_generation_tokens.observe(finished.num_generation_tokens)
            s.request_num_preemptions.observe(finished.num_preemptions)
            s.request_prefill_kv_computed_tokens.observe(
                finished.num_prompt_tokens - finished.num_cached_tokens
            )
            if finished.max_tokens_param:
                s.request_params_max_tokens.observe(finished.max_tokens_param)
            tpot = finished.mean_time_per_output_token
            if tpot is not None:
                s.request_time_per_output_token_seconds.observe(tpot)
            phases = finished.phases
            if phases is not None:
                s.request_queue_time_seconds.observe(phases.queued_time)
                s.request_prefill_time_seconds.observe(phases.prefill_time)
                s.request_decode_time_seconds.observe(phases.decode_time)
                s.request_inference_time_seconds.observe(phases.inference_time)
