"""Goodput, live (services/api/observability/slo_metrics.py): each finished request's targets
counted met or missed, in all and by tenant, the goodput window, the prediction error gauge."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvserve.services.api.engine_client.client import EngineClient
from kvserve.services.api.observability.metrics import ApiMetrics
from kvserve.services.api.observability.slo_metrics import (
    GOODPUT_WINDOW_S,
    SloMetrics,
    slo_outcomes,
)
from kvserve.services.api.observability.stats import FinishedRequestStats, IterationStats
from kvserve.services.api.serving.latency_targets import LatencyTargets
from kvserve.services.api.tenancy.usage import TenantCap
from kvserve.shared.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    SchedulerStats,
)
from kvserve.shared.sampling_params import SamplingParams


def finished(ttft, e2e, tokens, ttft_ms=None, tpot_ms=None, tenant="default"):
    return FinishedRequestStats(
        finish_reason="length",
        e2e_latency=e2e,
        num_prompt_tokens=3,
        num_generation_tokens=tokens,
        max_tokens_param=tokens,
        phases=None,
        tenant=tenant,
        time_to_first_token=ttft,
        ttft_target_ms=ttft_ms,
        tpot_target_ms=tpot_ms,
    )


def test_outcomes_follow_the_definitions():
    assert slo_outcomes(finished(0.1, 1.0, 10)) == {}
    # TTFT 100 ms; TPOT (1000 - 100) / 9 = 100 ms.
    assert slo_outcomes(finished(0.1, 1.0, 10, ttft_ms=100, tpot_ms=100)) == {
        "ttft": True,
        "tpot": True,
    }
    assert slo_outcomes(finished(0.1, 1.0, 10, ttft_ms=99, tpot_ms=99)) == {
        "ttft": False,
        "tpot": False,
    }
    # One token: no TPOT to judge; no token at all: the TTFT target was missed.
    assert slo_outcomes(finished(0.1, 0.1, 1, ttft_ms=200, tpot_ms=1)) == {"ttft": True}
    assert slo_outcomes(finished(None, 0.5, 0, ttft_ms=200, tpot_ms=1)) == {"ttft": False}


class _Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def _engines(error: float):
    return SimpleNamespace(
        per_engine_stats=lambda: [(0, SchedulerStats(step_time_prediction_error=error), None)]
    )


def _samples(registry) -> list:
    from prometheus_client import generate_latest

    text = generate_latest(registry).decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _value(samples, name, **labels) -> float:
    (match,) = [
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return match


def test_counts_by_target_and_tenant_and_the_goodput_window():
    registry, clock = CollectorRegistry(), _Clock()
    slo = SloMetrics(registry, _engines(0.125), "m", TenantCap(what="t"), clock)
    stats = IterationStats(0.0, 0.0)
    stats.finished_requests += [
        finished(0.1, 1.0, 10, ttft_ms=500, tpot_ms=200, tenant="a"),  # good
        finished(0.1, 1.0, 10, ttft_ms=50, tenant="b"),  # missed TTFT
        finished(0.1, 1.0, 10),  # no targets: not counted
    ]
    slo.record(0, stats)
    samples = _samples(registry)
    assert _value(samples, "kvserve:request_slo_total", target="ttft", outcome="met") == 1
    assert _value(samples, "kvserve:request_slo_total", target="ttft", outcome="missed") == 1
    assert _value(samples, "kvserve:request_slo_total", target="tpot", outcome="met") == 1
    assert _value(samples, "kvserve:request_slo_total", target="tpot", outcome="missed") == 0
    assert (
        _value(
            samples, "kvserve:tenant_request_slo_total", tenant="b", target="ttft", outcome="missed"
        )
        == 1
    )
    assert _value(samples, "kvserve:slo_goodput_requests_per_second") == 1 / GOODPUT_WINDOW_S
    assert _value(samples, "kvserve:step_time_prediction_error", engine="0") == 0.125
    clock.now += GOODPUT_WINDOW_S + 1
    assert _value(_samples(registry), "kvserve:slo_goodput_requests_per_second") == 0


def test_a_targeted_request_through_the_engine_client_is_counted():
    client = EngineClient(SimpleNamespace(tokenizer=None), max_model_len=512, model_name="m")
    metrics = ApiMetrics(client, "m")
    targets = LatencyTargets(ttft_ms=60_000.0, tpot_ms=0.001)
    client.output_processor.add_request(
        "r", None, [1, 2, 3], SamplingParams(max_tokens=3), targets=targets
    )
    steps = [
        EngineCoreOutputs([EngineCoreOutput("r", [5])], SchedulerStats(), timestamp=1.0),
        EngineCoreOutputs([EngineCoreOutput("r", [6])], SchedulerStats(), timestamp=2.0),
        EngineCoreOutputs(
            [EngineCoreOutput("r", [7], finish_reason=FinishReason.LENGTH)],
            SchedulerStats(),
            timestamp=3.0,
        ),
    ]

    async def deliver():
        for outputs in steps:
            await client._handle_outputs(outputs)

    asyncio.run(deliver())
    samples = _samples(metrics.registry)
    assert _value(samples, "kvserve:request_slo_total", target="ttft", outcome="met") == 1
    assert _value(samples, "kvserve:request_slo_total", target="tpot", outcome="missed") == 1
    assert _value(samples, "kvserve:slo_goodput_requests_per_second") == 0
