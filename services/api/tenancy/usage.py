"""Usage per tenant: requests and tokens in one-minute buckets, for GET /v1/usage.

`UsageLedger` takes each ended api request's `RequestUsage` (from ApiMetrics.record, with
the per-tenant series: at the request's last output, or its abort) and adds it to the
bucket of the wall-clock minute it ended in:

    minute ─▶ tenant ─▶ [requests, prompt_tokens, completion_tokens]

Tokens are those of the response's `usage` (the prompt once, every choice's tokens; for an
aborted request, those made before the client went away). `requests` counts engine requests,
one per choice, as kvserve:request_success does: a completions call with k prompts and n
choices counts k·n.

Bounded twice: buckets older than RETENTION_S (7 days) are dropped, and past MAX_CELLS
(minute, tenant) cells (~100 MB at worst) the oldest minutes go first, so a trusted tenant
header naming many tenants costs memory, not the server. TenantCap bounds the tenant names
(here and in the per-tenant Prometheus series): past MAX_TENANTS distinct names, new ones
count as "other".
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import msgspec

from kvserve.services.api.observability.stats import IterationStats
from kvserve.shared.logging import init_logger
from kvserve.shared.messages import SchedulerStats

logger = init_logger(__name__)

BUCKET_S = 60
RETENTION_S = 7 * 24 * 3600
MAX_CELLS = 500_000
MAX_TENANTS = 1000
OTHER_TENANT = "other"


class TenantCap:
    """Maps tenant names to at most `max_tenants` distinct values: a name seen before, or
    any while there is room, is itself; a new one past the cap is "other" (logged once).

    Args:
        max_tenants: distinct names kept.
        what: what the cap bounds, for the log line.
    """

    def __init__(self, max_tenants: int = MAX_TENANTS, what: str = "tenants"):
        self.max_tenants = max_tenants
        self.what = what
        self.names: set[str] = set()
        self._warned = False

    def __call__(self, tenant: str) -> str:
        if tenant in self.names:
            return tenant
        if len(self.names) < self.max_tenants:
            self.names.add(tenant)
            return tenant
        if not self._warned:
            self._warned = True
            logger.warning(
                "%s: more than %d distinct tenants; new ones count as %r",
                self.what,
                self.max_tenants,
                OTHER_TENANT,
            )
        return OTHER_TENANT


class TenantUsage(msgspec.Struct, kw_only=True):
    """One tenant's totals over the asked range."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class UsageReport(msgspec.Struct, kw_only=True):
    """GET /v1/usage's body: [start, end) widened to whole minutes, and each tenant's totals
    in it (tenants without a request in the range are left out)."""

    object: str = "usage"
    start: int
    end: int
    tenants: dict[str, TenantUsage]


class UsageLedger:
    """Per-tenant totals in one-minute buckets (see the module docstring).

    Args:
        clock: wall-clock seconds (time.time; tests inject their own).
        retention_s: how long a bucket is kept.
        max_cells: (minute, tenant) cells kept at most; the oldest minutes go first.
        max_tenants: distinct tenant names kept (TenantCap).
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        retention_s: int = RETENTION_S,
        max_cells: int = MAX_CELLS,
        max_tenants: int = MAX_TENANTS,
    ):
        self.clock = clock
        self.retention_s = retention_s
        self.max_cells = max_cells
        self.tenant_of = TenantCap(max_tenants, "GET /v1/usage")
        # minute -> tenant -> [requests, prompt tokens, completion tokens]; minutes in the
        # order they were first written (the clock's, unless it stepped back).
        self.buckets: dict[int, dict[str, list[int]]] = {}
        self.num_cells = 0

    def record(
        self,
        engine_index: int,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats,
    ) -> None:
        """Take one engine step's ended requests (the StatLogger protocol)."""
        if not iteration_stats.request_usages:
            return
        minute = int(self.clock() // BUCKET_S)
        bucket = self.buckets.get(minute)
        if bucket is None:
            bucket = self.buckets[minute] = {}
            self._evict(minute)
        for usage in iteration_stats.request_usages:
            tenant = self.tenant_of(usage.tenant)
            cell = bucket.get(tenant)
            if cell is None:
                cell = bucket[tenant] = [0, 0, 0]
                self.num_cells += 1
            cell[0] += len(usage.finish_reasons)
            cell[1] += usage.num_prompt_tokens
            cell[2] += usage.num_completion_tokens
        while self.num_cells > self.max_cells and len(self.buckets) > 1:
            self._drop_oldest()

    def _evict(self, minute: int) -> None:
        """Drop the buckets past retention, at the start of each new minute."""
        oldest_kept = minute - self.retention_s // BUCKET_S
        while self.buckets and next(iter(self.buckets)) < oldest_kept:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        bucket = self.buckets.pop(next(iter(self.buckets)))
        self.num_cells -= len(bucket)

    def report(self, start: float | None = None, end: float | None = None) -> UsageReport:
        """Each tenant's totals over the buckets that overlap [start, end).

        Args:
            start: unix seconds (None: the oldest bucket kept).
            end: unix seconds (None: now).
        """
        now_minute = math.floor(self.clock() / BUCKET_S)
        last = now_minute + 1 if end is None else math.ceil(end / BUCKET_S)
        if start is None:
            first = min(min(self.buckets, default=now_minute), last - 1)
        else:
            first = math.floor(start / BUCKET_S)
        last = max(last, first + 1)  # an instant (start == end on a minute's edge): its minute
        tenants: dict[str, TenantUsage] = {}
        for minute, bucket in self.buckets.items():
            if not first <= minute < last:
                continue
            for tenant, (requests, prompt, completion) in bucket.items():
                totals = tenants.setdefault(tenant, TenantUsage())
                totals.requests += requests
                totals.prompt_tokens += prompt
                totals.completion_tokens += completion
                totals.total_tokens += prompt + completion
        return UsageReport(
            start=first * BUCKET_S, end=last * BUCKET_S, tenants=dict(sorted(tenants.items()))
        )
