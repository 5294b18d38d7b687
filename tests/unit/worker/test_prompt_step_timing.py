"""Prompt steps timed at start-up for the latency targets: where targets are expected (the
engine's --slo-ttft-ms / --slo-tpot-ms, or --slo-step-timing, which a key file with targets
turns on), the workers time prompt chunks of PROMPT_TIMING_TOKENS and the scheduler's
step-time model starts from them instead of a GPU's guess; elsewhere nothing is timed."""

from __future__ import annotations

import pytest

from kvserve import LLM
from kvserve.services.scheduler.core.step_time import prior_from_step_costs
from kvserve.services.worker.step_timing import StepTimer
from tests.support.models import TINY_KV_CACHE_MEMORY


@pytest.fixture
def timed(monkeypatch) -> list[list[tuple[int, float]]]:
    """What each measure_prompt_costs call returned."""
    calls: list[list[tuple[int, float]]] = []
    real = StepTimer.measure_prompt_costs

    def measure(self, sched):
        calls.append(real(self, sched))
        return calls[-1]

    monkeypatch.setattr(StepTimer, "measure_prompt_costs", measure)
    return calls


@pytest.mark.parametrize(
    "targets", [{"slo_ttft_ms": 1000.0}, {"slo_tpot_ms": 100.0}, {"slo_step_timing": True}]
)
def test_with_targets_expected_the_model_starts_from_timed_prompt_steps(
    tiny_llama_dir, timed, targets
):
    llm = LLM(
        tiny_llama_dir, kv_cache_memory=TINY_KV_CACHE_MEMORY, max_num_batched_tokens=64, **targets
    )
    (costs,) = timed
    assert [n for n, _ in costs] == [16, 64]  # those within max_num_batched_tokens
    assert all(seconds > 0 for _, seconds in costs)
    assert llm.engine_core.scheduler.latency.model.prior == list(prior_from_step_costs(costs))


def test_without_targets_no_step_is_timed(tiny_llama_dir, timed):
    llm = LLM(tiny_llama_dir, kv_cache_memory=TINY_KV_CACHE_MEMORY, max_num_batched_tokens=64)
    assert timed == []
    assert llm.engine_core.scheduler.latency.model.prior == list(prior_from_step_costs([]))
