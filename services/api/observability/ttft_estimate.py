"""An estimate of a new request's time to first token, per engine, for --slo-admission reject
(services/api/serving/slo_admission.py).

The rule, kept simple on purpose (docs/api.md "Latency targets"):

    estimated TTFT = P50 of the engine's recent queue times   (only while it has waiting requests)
                   + its recent mean prefill time per prompt token x this prompt's tokens

"Recent" is the last WINDOW finished requests that produced a token (their PhaseTimes, engine
clock). Without history the estimate is 0: a fresh engine admits everything.
"""

from __future__ import annotations

import collections
import statistics

from kvserve.services.api.observability.stats import IterationStats
from kvserve.shared.messages import SchedulerStats

WINDOW = 64


class _EngineHistory:
    def __init__(self) -> None:
        self.queue_times: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.prefill_per_token: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.num_waiting = 0


class TtftEstimator:
    """A stat logger of the EngineClient (`engine_client.stat_loggers`) that keeps each
    engine's recent queue and prefill times."""

    def __init__(self) -> None:
        self._engines: dict[int, _EngineHistory] = {}

    def record(
        self,
        engine_index: int,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats,
    ) -> None:
        history = self._engines.setdefault(engine_index, _EngineHistory())
        if scheduler_stats is not None:
            history.num_waiting = scheduler_stats.num_waiting_reqs
        for finished in iteration_stats.finished_requests:
            phases = finished.phases
            if phases is None or finished.num_prompt_tokens <= 0:
                continue
            history.queue_times.append(phases.queued_time)
            history.prefill_per_token.append(phases.prefill_time / finished.num_prompt_tokens)

    def estimate_s(self, num_prompt_tokens: int) -> float:
        """The estimated TTFT in seconds of a prompt of this length on the engine where it
        looks shortest (0 without history)."""
        estimates = [
            self._engine_estimate(history, num_prompt_tokens) for history in self._engines.values()
        ]
        return min(estimates, default=0.0)

    @staticmethod
    def _engine_estimate(history: _EngineHistory, num_prompt_tokens: int) -> float:
        queue = 0.0
        if history.num_waiting > 0 and history.queue_times:
            queue = statistics.median(history.queue_times)
        prefill = 0.0
        if history.prefill_per_token:
            prefill = statistics.fmean(history.prefill_per_token) * num_prompt_tokens
        return queue + prefill
