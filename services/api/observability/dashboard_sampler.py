"""Readings of the api's cumulative figures over the last minutes, for the status page
(dashboard.py turns them into GET /dashboard/state's JSON).

Nothing is counted twice: a reading takes tokens, finished requests, TTFT and ITL buckets
from ApiMetrics' Prometheus series, and the engines' loads and counter sums from the engine
client's `per_engine_stats` (as /metrics reads them). Figures "over the last minutes" are
differences of readings. `DashboardSampler` reads the
cumulative series (histogram buckets, counters) at most once a second, driven by the engine
steps (it is a StatLogger) with a trailing read one interval after the last step, so the
newest reading never misses the end of a burst; readings older than the window are dropped,
but the newest of them stays as the window's start:

    readings  r0 ........ r(k) | r(k+1) ... r(n)   now
                          └────┴─ window (WINDOW_S) ──┘
    TTFT p90 over the window = quantile of (buckets at now − buckets at r(k))

A percentile is read from bucket deltas as Prometheus' histogram_quantile does (linear
within the bucket; past the last finite bound, that bound).
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvserve.services.api.engine_client.client import EngineClient
from kvserve.services.api.observability.metrics import ApiMetrics
from kvserve.services.api.observability.stats import IterationStats
from kvserve.shared.messages import SchedulerStats

WINDOW_S = 300.0  # percentiles, hit rates and acceptance: the last 5 minutes
RATE_WINDOW_S = 10.0  # throughput "now": the last 10 seconds
SAMPLE_INTERVAL_S = 1.0  # readings at most this often
NUM_HISTORY_POINTS = 60  # the charts: 60 points of 5 s over the window
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True, slots=True)
class Reading:
    """The cumulative figures at one instant (monotonic seconds), summed over engines."""

    time: float
    ttft_buckets: tuple[float, ...]  # cumulative counts per bound of TTFT_BOUNDS, then +Inf
    itl_buckets: tuple[float, ...]
    prompt_tokens: float
    generation_tokens: float
    finished_requests: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    spec_num_drafts: int
    spec_num_draft_tokens: int
    spec_num_accepted_tokens: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float


def histogram_buckets(series) -> tuple[list[float], list[float]]:
    """(finite upper bounds, cumulative counts with +Inf last) of a Prometheus histogram,
    summed over its labelled children."""
    counts: dict[float, float] = {}
    for family in series.collect():
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                counts[bound] = counts.get(bound, 0.0) + sample.value
    bounds = sorted(counts)
    return [b for b in bounds if b != float("inf")], [counts[b] for b in bounds]


def counter_total(series) -> float:
    """A Prometheus counter's value summed over its labelled children."""
    return sum(
        sample.value
        for family in series.collect()
        for sample in family.samples
        if sample.name.endswith("_total")
    )


def quantile(q: float, bounds: Sequence[float], cumulative: Sequence[float]) -> float | None:
    """The q-quantile of a histogram's (cumulative) bucket counts, as histogram_quantile:
    linear within its bucket; in the +Inf bucket, the last finite bound; None when empty."""
    total = cumulative[-1] if cumulative else 0
    if total <= 0:
        return None
    rank = q * total
    index = bisect.bisect_left(cumulative, rank)
    if index >= len(bounds):
        return bounds[-1] if bounds else None
    lower = bounds[index - 1] if index > 0 else 0.0
    below = cumulative[index - 1] if index > 0 else 0.0
    in_bucket = cumulative[index] - below
    if in_bucket <= 0:
        return bounds[index]
    return lower + (bounds[index] - lower) * (rank - below) / in_bucket


def ratio(numerator: float, denominator: float) -> float | None:
    """None without a denominator, or for a negative difference (an engine's sums started
    again from zero: a replaced engine)."""
    return numerator / denominator if denominator > 0 and numerator >= 0 else None


class DashboardSampler:
    """Readings of the api's series over the last WINDOW_S (see the module docstring).

    Args:
        engine_client: the engines (states, loads, counter sums).
        metrics: the api's Prometheus series (tokens, requests, TTFT, ITL).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self,
        engine_client: EngineClient,
        metrics: ApiMetrics,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.engine_client = engine_client
        self.metrics = metrics
        self.clock = clock
        self.ttft_bounds = histogram_buckets(metrics.series("time_to_first_token_seconds"))[0]
        self.itl_bounds = histogram_buckets(metrics.series("inter_token_latency_seconds"))[0]
        self.readings: deque[Reading] = deque([self.read()])
        self.start_time = self.readings[0].time
        self._trailing_read: asyncio.TimerHandle | None = None

    def read(self) -> Reading:
        """The figures now."""
        per_engine = self.engine_client.per_engine_stats()
        latest = [stats for _, stats, _ in per_engine if stats is not None]
        totals = [totals for _, _, totals in per_engine]
        series = self.metrics.series
        return Reading(
            time=self.clock(),
            ttft_buckets=tuple(histogram_buckets(series("time_to_first_token_seconds"))[1]),
            itl_buckets=tuple(histogram_buckets(series("inter_token_latency_seconds"))[1]),
            prompt_tokens=counter_total(series("prompt_tokens")),
            generation_tokens=counter_total(series("generation_tokens")),
            finished_requests=counter_total(self.metrics.request_success),
            prefix_cache_queries=sum(t.prefix_cache_queries for t in totals),
            prefix_cache_hits=sum(t.prefix_cache_hits for t in totals),
            spec_num_drafts=sum(t.spec_num_drafts for t in totals),
            spec_num_draft_tokens=sum(t.spec_num_draft_tokens for t in totals),
            spec_num_accepted_tokens=sum(t.spec_num_accepted_tokens for t in totals),
            num_running=sum(s.num_running_reqs for s in latest),
            num_waiting=sum(s.num_waiting_reqs for s in latest),
            kv_cache_usage=kv_cache_usage(self.engine_client, per_engine),
        )

    def sample(self) -> Reading:
        """Read now; keep the reading when the last kept one is SAMPLE_INTERVAL_S old."""
        reading = self.read()
        if reading.time - self.readings[-1].time >= SAMPLE_INTERVAL_S:
            self.readings.append(reading)
            # Keep one reading at or before the window's start: the base of its deltas.
            start = reading.time - WINDOW_S
            while len(self.readings) > 1 and self.readings[1].time <= start:
                self.readings.popleft()
        return reading

    def at(self, when: float) -> Reading | None:
        """The newest kept reading at or before `when` (None: before the first)."""
        index = bisect.bisect_right(self.readings, when, key=lambda r: r.time)
        return self.readings[index - 1] if index > 0 else None

    def record(
        self,
        engine_index: int,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats,
    ) -> None:
        """An engine step happened (the StatLogger protocol): read now, or one interval after
        the last reading, so the end of a burst is always read."""
        wait_s = self.readings[-1].time + SAMPLE_INTERVAL_S - self.clock()
        if wait_s <= 0:
            self.sample()
            return
        if self._trailing_read is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # outside an event loop: the next step or state reads it
            return
        self._trailing_read = loop.call_later(wait_s, self._read_after_burst)

    def _read_after_burst(self) -> None:
        self._trailing_read = None
        self.sample()


def kv_cache_usage(engine_client: EngineClient, per_engine) -> float:
    """Every engine's KV usage, weighted by its number of blocks (equal weights when the
    block counts are unknown)."""
    num_blocks = {
        ready.engine_index: ready.num_blocks for ready in engine_client.engine_handshakes()
    }
    used = total = 0.0
    for engine_index, stats, _ in per_engine:
        weight = num_blocks.get(engine_index, 1)
        total += weight
        used += weight * (stats.kv_cache_usage if stats is not None else 0.0)
    return used / total if total else 0.0
