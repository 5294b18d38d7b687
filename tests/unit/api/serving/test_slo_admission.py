"""--slo-admission reject (services/api/serving/slo_admission.py): the TTFT estimate from the
engines' recent queue and prefill times, and the 503 for a target it says is out of reach."""

from __future__ import annotations

import pytest

from kvserve.services.api.observability.stats import (
    FinishedRequestStats,
    IterationStats,
    PhaseTimes,
)
from kvserve.services.api.observability.ttft_estimate import TtftEstimator
from kvserve.services.api.serving.errors import APIError
from kvserve.services.api.serving.latency_targets import LatencyTargets
from kvserve.services.api.serving.slo_admission import SloAdmission
from kvserve.shared.messages import SchedulerStats


def _step(queued: float, prefill: float, num_prompt_tokens: int) -> IterationStats:
    stats = IterationStats(0.0, 0.0)
    phases = PhaseTimes(queued, prefill, 0.1, prefill + 0.1)
    stats.finished_requests.append(
        FinishedRequestStats("stop", 1.0, num_prompt_tokens, 2, 2, phases)
    )
    return stats


def test_no_history_estimates_zero_and_admits():
    admission = SloAdmission(TtftEstimator())
    admission.check(LatencyTargets(ttft_ms=0.01), 1000)


def test_the_estimate_is_queue_p50_while_waiting_plus_prefill_per_token():
    estimator = TtftEstimator()
    for queued in (0.1, 0.2, 0.9):
        estimator.record(0, SchedulerStats(num_waiting_reqs=0), _step(queued, 0.01, 10))
    # Nobody waiting: the prefill alone, 1 ms a token.
    assert estimator.estimate_s(100) == pytest.approx(0.1)
    estimator.record(0, SchedulerStats(num_waiting_reqs=3), IterationStats(0.0, 0.0))
    assert estimator.estimate_s(100) == pytest.approx(0.2 + 0.1)
    # A second engine with no queue: the shortest estimate counts.
    estimator.record(1, SchedulerStats(), _step(0.0, 0.001, 10))
    assert estimator.estimate_s(100) == pytest.approx(0.01)


def test_an_unreachable_target_is_a_503_with_retry_after():
    estimator = TtftEstimator()
    estimator.record(0, SchedulerStats(num_waiting_reqs=1), _step(2.5, 0.01, 10))
    admission = SloAdmission(estimator)
    admission.check(LatencyTargets(ttft_ms=5000), 10)  # 2.51 s estimated: within
    admission.check(LatencyTargets(tpot_ms=0.01), 10)  # no TTFT target: admitted
    with pytest.raises(APIError) as info:
        admission.check(LatencyTargets(ttft_ms=100), 10)
    assert info.value.status_code == 503
    assert info.value.headers == {"Retry-After": "3"}
    assert "TTFT target of 100 ms" in info.value.message
