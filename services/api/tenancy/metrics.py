"""Prometheus series per tenant (services/api/tenancy/tenants.py), labelled `tenant`:

- kvserve:tenant_prompt_tokens_total, kvserve:tenant_generation_tokens_total: the tokens of
  each ended request as its response's `usage` counts them (the prompt once, every choice's
  tokens; an aborted request's tokens so far), so they sum to what the tenant's clients saw;
- kvserve:tenant_requests_total{finished_reason}: engine requests, one per choice, as
  kvserve:request_success (abort: the client went away);
- kvserve:tenant_request_queue_time_seconds, kvserve:tenant_time_to_first_token_seconds:
  kvserve:request_queue_time_seconds and kvserve:time_to_first_token_seconds by tenant;
- kvserve:tenant_num_requests_running, kvserve:tenant_num_requests_waiting: scrape-time
  gauges, the engines' latest SchedulerStats summed over engines.

A trusted tenant header may name any tenant: past usage.MAX_TENANTS distinct names, new
ones are labelled "other" (usage.TenantCap).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from kvserve.services.api.observability.stats import IterationStats
from kvserve.services.api.tenancy.usage import TenantCap


class _TenantLoadCollector:
    """Running and waiting requests per tenant, summed over the engines' latest stats; a
    tenant seen once stays in the series (at 0 when idle)."""

    def __init__(self, engine_client, tenant_of: TenantCap):
        self.engine_client = engine_client
        self.tenant_of = tenant_of

    def collect(self):
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for _, stats, _ in self.engine_client.per_engine_stats():
            if stats is None:
                continue
            for counts, by_tenant in (
                (running, stats.running_by_tenant),
                (waiting, stats.waiting_by_tenant),
            ):
                for tenant, num_requests in by_tenant.items():
                    label = self.tenant_of(tenant)
                    counts[label] = counts.get(label, 0) + num_requests
        for name, doc, counts in (
            ("kvserve:tenant_num_requests_running", "Requests running, by tenant.", running),
            ("kvserve:tenant_num_requests_waiting", "Requests waiting, by tenant.", waiting),
        ):
            family = GaugeMetricFamily(name, doc, labels=["tenant"])
            for tenant in sorted(self.tenant_of.names | counts.keys()):
                family.add_metric([tenant], counts.get(tenant, 0))
            yield family


class TenantMetrics:
    """The per-tenant series, in `registry`; `record` takes each engine step's figures.

    Args:
        registry: the api's registry.
        engine_client: the engines whose latest stats the gauges read.
        ttft_buckets, queue_buckets: the buckets of the non-tenant histograms.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        engine_client,
        ttft_buckets: list[float],
        queue_buckets: list[float],
    ):
        self.tenant_of = TenantCap(what="the tenant label of /metrics")
        registry.register(_TenantLoadCollector(engine_client, self.tenant_of))
        self.prompt_tokens = Counter(
            "kvserve:tenant_prompt_tokens",
            "Prompt tokens of ended requests, by tenant (usage.prompt_tokens).",
            ["tenant"],
            registry=registry,
        )
        self.generation_tokens = Counter(
            "kvserve:tenant_generation_tokens",
            "Generated tokens of ended requests, by tenant (usage.completion_tokens).",
            ["tenant"],
            registry=registry,
        )
        self.requests = Counter(
            "kvserve:tenant_requests",
            "Ended engine requests (one per choice), by tenant and finished reason.",
            ["tenant", "finished_reason"],
            registry=registry,
        )
        self.queue_time = Histogram(
            "kvserve:tenant_request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request, by tenant.",
            ["tenant"],
            buckets=queue_buckets,
            registry=registry,
        )
        self.quota_refusals = Counter(
            "kvserve:tenant_quota_refusals",
            "Requests a tenant quota refused (429, or 400 past the whole tokens_per_minute), "
            "by tenant and limit.",
            ["tenant", "limit"],
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            "kvserve:tenant_time_to_first_token_seconds",
            "Histogram of time to first token in seconds, by tenant.",
            ["tenant"],
            buckets=ttft_buckets,
            registry=registry,
        )

    def quota_refused(self, tenant: str, limit: str) -> None:
        """A quota (`limit`: max_concurrent, requests_per_minute, tokens_per_minute) refused
        one of the tenant's requests."""
        self.quota_refusals.labels(self.tenant_of(tenant), limit).inc()

    def record(self, iteration_stats: IterationStats) -> None:
        """Take one engine step's (or abort's) figures."""
        for tenant, ttft in zip(
            iteration_stats.first_token_tenants, iteration_stats.time_to_first_tokens
        ):
            self.time_to_first_token.labels(self.tenant_of(tenant)).observe(ttft)
        for finished in iteration_stats.finished_requests:
            if finished.phases is not None:
                tenant = self.tenant_of(finished.tenant)
                self.queue_time.labels(tenant).observe(finished.phases.queued_time)
        for usage in iteration_stats.request_usages:
            tenant = self.tenant_of(usage.tenant)
            self.prompt_tokens.labels(tenant).inc(usage.num_prompt_tokens)
            self.generation_tokens.labels(tenant).inc(usage.num_completion_tokens)
            for reason in usage.finish_reasons:
                self.requests.labels(tenant, reason).inc()
