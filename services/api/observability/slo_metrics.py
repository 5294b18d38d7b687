"""Goodput, live: how the requests that had latency targets fared (docs/observability.md).

- kvserve:request_slo_total{model_name, engine, target="ttft"|"tpot",
  outcome="met"|"missed"}: one count per
  finished engine request and target it had (the api's own targets: the body's, a header's or
  its tenant's; not the engine's --slo-*-ms defaults, which the api does not know). TTFT is
  the api's arrival -> first token (kvserve:time_to_first_token_seconds' figure); TPOT is
  (e2e - TTFT) / (output tokens - 1), counted only past one output token. A request that
  ended without a token missed its TTFT target.
- kvserve:tenant_request_slo_total{tenant, target, outcome}: the same by tenant.
- kvserve:slo_goodput_requests_per_second{model_name, engine}: targeted requests that met
  every target they had, over the last GOODPUT_WINDOW_S seconds, per second.
- kvserve:step_time_prediction_error{model_name, engine}: the engine's EWMA of
  |predicted - measured| / measured step time (SchedulerStats), read at scrape time.

All are kvserve's own series: --metrics-prefix vllm leaves their names alone.
"""

from __future__ import annotations

import collections
import time

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

from kvserve.services.api.observability.stats import FinishedRequestStats, IterationStats
from kvserve.services.api.tenancy.usage import TenantCap

GOODPUT_WINDOW_S = 60.0
LABELS = ["model_name", "engine"]


def slo_outcomes(finished: FinishedRequestStats) -> dict[str, bool]:
    """{target: met} for each target the finished request had ("ttft", "tpot"); a TPOT
    target is judged only for a request with more than one output token."""
    outcomes: dict[str, bool] = {}
    ttft = finished.time_to_first_token
    if finished.ttft_target_ms is not None:
        outcomes["ttft"] = ttft is not None and ttft * 1000.0 <= finished.ttft_target_ms
    if (
        finished.tpot_target_ms is not None
        and ttft is not None
        and finished.num_generation_tokens > 1
    ):
        tpot = (finished.e2e_latency - ttft) / (finished.num_generation_tokens - 1)
        outcomes["tpot"] = tpot * 1000.0 <= finished.tpot_target_ms
    return outcomes


class _EngineGaugesCollector:
    """Per engine, at scrape time: its latest step_time_prediction_error and its goodput."""

    def __init__(self, engine_client, model_name: str, goodput):
        self.engine_client = engine_client
        self.model_name = model_name
        self.goodput = goodput

    def collect(self):
        error = GaugeMetricFamily(
            "kvserve:step_time_prediction_error",
            "The engine's EWMA of |predicted - measured| / measured step time.",
            labels=LABELS,
        )
        goodput = GaugeMetricFamily(
            "kvserve:slo_goodput_requests_per_second",
            f"Requests with targets that met all of them, per second over the last "
            f"{GOODPUT_WINDOW_S:.0f} s.",
            labels=LABELS,
        )
        for engine_index, stats, _ in self.engine_client.per_engine_stats():
            labels = [self.model_name, str(engine_index)]
            error.add_metric(labels, stats.step_time_prediction_error if stats else 0.0)
            goodput.add_metric(labels, self.goodput(engine_index))
        yield error
        yield goodput


class SloMetrics:
    """The latency-target series, in `registry`; `record` takes each engine step's figures.

    Args:
        registry: the api's registry.
        engine_client: the engines whose stats the gauges read.
        model_name: the served model name (the model_name label).
        tenant_of: the tenant label of a tenant name (the tenant series' cap).
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        engine_client,
        model_name: str,
        tenant_of: TenantCap,
        clock=time.monotonic,
    ):
        self.model_name = model_name
        self.tenant_of = tenant_of
        self.clock = clock
        self._good_times: dict[int, collections.deque[float]] = {}
        self._tenant_good_times: dict[str, collections.deque[float]] = {}
        registry.register(_EngineGaugesCollector(engine_client, model_name, self.goodput))
        self.outcomes = Counter(
            "kvserve:request_slo",
            "Finished requests with a latency target, by target and whether it was met.",
            [*LABELS, "target", "outcome"],
            registry=registry,
        )
        self.tenant_outcomes = Counter(
            "kvserve:tenant_request_slo",
            "kvserve:request_slo_total by tenant.",
            ["tenant", "target", "outcome"],
            registry=registry,
        )
        for engine_index, _, _ in engine_client.per_engine_stats():
            for target in ("ttft", "tpot"):
                for outcome in ("met", "missed"):
                    self.outcomes.labels(model_name, str(engine_index), target, outcome)

    def record(self, engine_index: int, iteration_stats: IterationStats) -> None:
        """Count the targets of the requests this step of engine `engine_index` finished."""
        for finished in iteration_stats.finished_requests:
            outcomes = slo_outcomes(finished)
            if not outcomes:
                continue
            tenant = self.tenant_of(finished.tenant)
            for target, met in outcomes.items():
                outcome = "met" if met else "missed"
                self.outcomes.labels(self.model_name, str(engine_index), target, outcome).inc()
                self.tenant_outcomes.labels(tenant, target, outcome).inc()
            if all(outcomes.values()):
                now = self.clock()
                self._good_times.setdefault(engine_index, collections.deque()).append(now)
                self._tenant_good_times.setdefault(tenant, collections.deque()).append(now)

    def goodput(self, engine_index: int) -> float:
        """The engine's requests that met all their targets, per second over the window."""
        return self._rate(self._good_times.get(engine_index))

    def tenant_goodput(self, tenant: str) -> float:
        """goodput() of one tenant's requests (its label, as tenant_outcomes has it), over
        every engine."""
        return self._rate(self._tenant_good_times.get(tenant))

    def _rate(self, good_times: collections.deque[float] | None) -> float:
        if not good_times:
            return 0.0
        horizon = self.clock() - GOODPUT_WINDOW_S
        while good_times and good_times[0] < horizon:
            good_times.popleft()
        return len(good_times) / GOODPUT_WINDOW_S

    def outcome_counts(self) -> dict[tuple[str, str], int]:
        """{(target, outcome): finished requests} since the api started, over engines."""
        return _counts(self.outcomes, ())

    def tenant_outcome_counts(self) -> dict[str, dict[tuple[str, str], int]]:
        """outcome_counts() per tenant label."""
        by_tenant: dict[str, dict[tuple[str, str], int]] = {}
        for (tenant, target, outcome), count in _counts(self.tenant_outcomes, ("tenant",)).items():
            by_tenant.setdefault(tenant, {})[(target, outcome)] = count
        return by_tenant


def _counts(counter: Counter, keys: tuple[str, ...]) -> dict:
    """A request_slo counter's `_total` samples summed by (*keys, target, outcome)."""
    counts: dict = {}
    for family in counter.collect():
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            labels = sample.labels
            key = (*(labels[k] for k in keys), labels["target"], labels["outcome"])
            counts[key] = counts.get(key, 0) + int(sample.value)
    return counts
