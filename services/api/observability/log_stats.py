"""The periodic stats line of the api process, as vLLM's LoggingStatLogger writes it.

    Engine 000: Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 95.0
    tokens/s, Running: 4 reqs, Waiting: 0 reqs, GPU KV cache usage: 3.1%, Prefix cache hit
    rate: 42.0%

One line per engine core and interval (10 s) in which it computed tokens or held requests;
none while it is idle, so an idle server's log stays quiet. `--disable-log-stats` turns it
off. The timer is armed by the first step after a quiet spell and re-armed while there is
activity: no task lingers on an idle server.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from kvserve.services.api.observability.stats import IterationStats
from kvserve.shared.logging import init_logger
from kvserve.shared.messages import SchedulerStats

logger = init_logger(__name__)

LOG_INTERVAL_S = 10.0


@dataclass(slots=True)
class _Interval:
    """One engine's figures since the last line."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    latest: SchedulerStats | None = None
    hit_rate: float = 0.0  # the last interval's with queries, kept through ones without

    @property
    def active(self) -> bool:
        busy = self.latest is not None and (
            self.latest.num_running_reqs > 0 or self.latest.num_waiting_reqs > 0
        )
        return busy or self.num_prompt_tokens > 0 or self.num_generation_tokens > 0

    def line(self, engine_index: int, elapsed_s: float) -> str:
        if self.prefix_cache_queries > 0:
            self.hit_rate = self.prefix_cache_hits / self.prefix_cache_queries
        latest = self.latest or SchedulerStats()
        return (
            f"Engine {engine_index:03d}: "
            f"Avg prompt throughput: {self.num_prompt_tokens / elapsed_s:.1f} tokens/s, "
            f"Avg generation throughput: {self.num_generation_tokens / elapsed_s:.1f} tokens/s, "
            f"Running: {latest.num_running_reqs} reqs, "
            f"Waiting: {latest.num_waiting_reqs} reqs, "
            f"GPU KV cache usage: {latest.kv_cache_usage * 100:.1f}%, "
            f"Prefix cache hit rate: {self.hit_rate * 100:.1f}%"
        )

    def restart(self) -> None:
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.prefix_cache_queries = self.prefix_cache_hits = 0


class LoggingStatLogger:
    """Logs each engine's throughput and load every interval while it is active.

    A stat logger of the EngineClient (`engine_client.stat_loggers`): `record` runs on the
    event loop for each engine step.

    Args:
        interval_s: seconds between two lines.
    """

    def __init__(self, interval_s: float = LOG_INTERVAL_S):
        self.interval_s = interval_s
        self._intervals: dict[int, _Interval] = {}
        self.interval_start = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None

    def record(
        self,
        engine_index: int,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats,
    ) -> None:
        interval = self._intervals.setdefault(engine_index, _Interval())
        interval.num_prompt_tokens += iteration_stats.num_prompt_tokens
        interval.num_generation_tokens += iteration_stats.num_generation_tokens
        if scheduler_stats is not None:
            interval.latest = scheduler_stats
            interval.prefix_cache_queries += scheduler_stats.prefix_cache_queries
            interval.prefix_cache_hits += scheduler_stats.prefix_cache_hits
        if self._timer is None:
            self._arm(restart=True)

    def _arm(self, restart: bool) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no event loop (a test drives it): `log` is called by hand
        if restart:  # the first step after a quiet spell opens a new interval
            self.interval_start = time.monotonic()
        self._timer = loop.call_later(self.interval_s, self.log)

    def log(self, now: float | None = None) -> list[str]:
        """Log (and return) the lines of the interval that ends now (time.monotonic())."""
        now = time.monotonic() if now is None else now
        elapsed_s = max(now - self.interval_start, 1e-9)
        self.interval_start = now
        self._timer = None
        lines = []
        for engine_index, interval in sorted(self._intervals.items()):
            if interval.active:
                lines.append(interval.line(engine_index, elapsed_s))
            interval.restart()
        for line in lines:
            logger.info("%s", line)
        if lines:
            self._arm(restart=False)
        return lines
