"""Prometheus metrics of the api process, with vLLM's names under the `kvserve:` prefix.

Two sources:
- the engine's load (`EngineClient.latest_stats`) and the sums of its per-step counters
  (`EngineClient.stats_totals`), read at scrape time by a custom collector;
- per-request timings measured here, around each request's stream of RequestOutputs.

`kvserve:request_queue_time_seconds` is an approximation: the core does not report when a
request was first scheduled, so it is the time from arrival to the first output (which also
holds the prefill). Every series has a `model_name` label, as vLLM's do; with data
parallelism (more than one engine core) the engine series also carry an `engine` label, one
series per engine, and `kvserve:engine_up` says which engines serve (1) or are gone (0).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvserve.services.api.outputs import RequestOutput

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
_ITL_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


_GAUGES = (
    (
        "kvserve:num_requests_running",
        "Requests in the engine's running batch.",
        lambda stats: stats.num_running_reqs,
    ),
    (
        "kvserve:num_requests_waiting",
        "Requests waiting to be scheduled.",
        lambda stats: stats.num_waiting_reqs,
    ),
    (
        "kvserve:kv_cache_usage_perc",
        "Fraction of KV-cache blocks in use (0..1).",
        lambda stats: stats.kv_cache_usage,
    ),
)
_COUNTERS = (
    (
        "kvserve:num_preemptions",
        "Requests preempted by the scheduler.",
        lambda totals: totals.num_preemptions,
    ),
    (
        "kvserve:prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
        lambda totals: totals.prefix_cache_queries,
    ),
    (
        "kvserve:prefix_cache_hits",
        "Prompt tokens found in the prefix cache.",
        lambda totals: totals.prefix_cache_hits,
    ),
)


class _EngineStatsCollector:
    """Reads each engine's latest load and counter sums whenever /metrics is scraped."""

    def __init__(self, engine_client, model_name: str):
        self.engine_client = engine_client
        self.model_name = model_name

    def collect(self):
        per_engine = self.engine_client.per_engine_stats()
        # One engine keeps vLLM's single-engine series; several get an `engine` label.
        labelled = len(per_engine) > 1
        names = ["model_name", "engine"] if labelled else ["model_name"]

        def label_values(engine_index: int) -> list[str]:
            return [self.model_name, str(engine_index)] if labelled else [self.model_name]

        for name, doc, read in _GAUGES:
            family = GaugeMetricFamily(name, doc, labels=names)
            for engine_index, stats, _ in per_engine:
                family.add_metric(label_values(engine_index), read(stats) if stats else 0)
            yield family
        for name, doc, read in _COUNTERS:
            family = CounterMetricFamily(name, doc, labels=names)
            for engine_index, _, totals in per_engine:
                family.add_metric(label_values(engine_index), read(totals))
            yield family
        if labelled:
            states = {
                entry["engine"]: entry["state"]
                for entry in self.engine_client.health_report()["engines"]
            }
            family = GaugeMetricFamily(
                "kvserve:engine_up",
                "1 while the engine core serves, 0 once it is gone.",
                labels=names,
            )
            for engine_index, _, _ in per_engine:
                family.add_metric(
                    label_values(engine_index), float(states.get(engine_index) != "dead")
                )
            yield family


class ApiMetrics:
    """The api's metrics, in a registry of their own (several apps may share a process).

    Args:
        engine_client: the EngineClient whose stats the gauges and engine counters show.
        model_name: the served model name (the `model_name` label).
    """

    def __init__(self, engine_client, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(engine_client, model_name))
        labels = ["model_name"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(
                model_name
            )

        self.prompt_tokens = counter("kvserve:prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("kvserve:generation_tokens", "Generated tokens.")
        self.request_success = Counter(
            "kvserve:request_success",
            "Requests that finished, by finish reason.",
            labels + ["finished_reason"],
            registry=self.registry,
        )
        self.model_name = model_name
        self.time_to_first_token = histogram(
            "kvserve:time_to_first_token_seconds",
            "Time to the first generated token.",
            _TTFT_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "kvserve:inter_token_latency_seconds",
            "Time between two outputs of a request.",
            _ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "kvserve:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            _REQUEST_BUCKETS,
        )
        self.request_queue_time = histogram(
            "kvserve:request_queue_time_seconds",
            "Time from arrival to the first output (approximates the time spent waiting).",
            _REQUEST_BUCKETS,
        )

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    async def observe(
        self, outputs: AsyncIterator[RequestOutput], arrival_time: float | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """Pass one request's cumulative outputs through, timing them on the way.

        Args:
            outputs: the EngineClient.generate stream of one request (closed here at the end,
                so that closing this generator early still aborts the request).
            arrival_time: time.monotonic() when the request arrived (default: now).
        """
        arrival = time.monotonic() if arrival_time is None else arrival_time
        last_output_time: float | None = None
        num_generated = 0
        try:
            async for output in outputs:
                now = time.monotonic()
                num_total = sum(len(c.token_ids) for c in output.outputs)
                num_new = num_total - num_generated
                if num_new > 0:
                    if last_output_time is None:
                        self.time_to_first_token.observe(now - arrival)
                        self.request_queue_time.observe(now - arrival)
                        self.prompt_tokens.inc(len(output.prompt_token_ids))
                    else:
                        self.inter_token_latency.observe(now - last_output_time)
                    self.generation_tokens.inc(num_new)
                    last_output_time, num_generated = now, num_total
                if output.finished:
                    self.e2e_request_latency.observe(now - arrival)
                    for completion in output.outputs:
                        self.request_success.labels(
                            self.model_name, completion.finish_reason or "abort"
                        ).inc()
                yield output
        finally:
            await outputs.aclose()
