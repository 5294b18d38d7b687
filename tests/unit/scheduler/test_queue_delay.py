"""The predicted queue delay an engine publishes for DP routing (queue_delay.py), on the real
Scheduler with a fake model and a step-time model of known coefficients."""

from __future__ import annotations

import pytest

from kvserve.services.scheduler.core.queue_delay import predicted_queue_delay_s
from kvserve.services.scheduler.core.step_time import StepShape, attended
from tests.support.kv import assert_no_leaked_blocks
from tests.support.scheduler import create_request, create_scheduler, run_to_completion, step

# 10 ms a step, 0.1 s per 1k prompt tokens, 10 ms per 100 decode rows, 10 ms per 1M keys
# (nothing for drafts nor per prompt chunk).
COEFFICIENTS = [0.010, 0.100, 0.010, 0.010, 0.0, 0.0]
BUDGET = 256


def _scheduler():
    scheduler = create_scheduler(max_num_batched_tokens=BUDGET, max_model_len=4096)
    scheduler.latency.model.coefficients = list(COEFFICIENTS)
    return scheduler


def _delay(scheduler) -> float:
    return predicted_queue_delay_s(scheduler.latency.model, scheduler.requests.values(), BUDGET)


def test_an_idle_engine_predicts_no_delay():
    assert _delay(_scheduler()) == 0.0


def test_waiting_prompts_cost_their_chunks_and_decodes_one_step():
    scheduler = _scheduler()
    scheduler.add_request(create_request("decode", 10, max_tokens=50))
    step(scheduler)  # its prompt in one step: now a decode
    assert [r.req_id for r in scheduler.running] == ["decode"]
    decode_only = _delay(scheduler)
    model = scheduler.latency.model
    assert decode_only == pytest.approx(model.predict(StepShape(0, 1, attended(1, 10))))

    scheduler.add_request(create_request("long", 1000))
    # 1000 prompt tokens in chunks of 255 beside the decode: four steps.
    expected = 4 * 0.010 + 1000 * 1e-4 + 4 * 1e-4 + (attended(1000, 0) + 4 * 11) * 1e-8
    assert _delay(scheduler) == pytest.approx(expected)
    assert _delay(scheduler) > decode_only

    step(scheduler)  # the first chunk is computed: less is ahead
    assert _delay(scheduler) < expected
    run_to_completion(scheduler)
    assert _delay(scheduler) == 0.0
    assert_no_leaked_blocks(scheduler)
