"""The step-time model (step_time.py): its fit from measured steps, its refit when the machine
changes, its prior, and the shape of a real Scheduler's step."""

from __future__ import annotations

import random

import pytest

from kvserve.services.scheduler.core.step_time import (
    StepShape,
    StepTimeModel,
    attended,
    prior_from_step_costs,
    shape_of,
)
from tests.support.scheduler import create_request, create_scheduler, step

# Seconds: a step, per 1k prompt tokens, per 100 decode rows, per 1M keys, per 100 drafts,
# per prompt chunk.
TRUE_COEFFICIENTS = [0.004, 0.080, 0.012, 0.020, 0.006, 0.010]


def _random_shape(rng: random.Random) -> StepShape:
    """A step as a server sees them: mostly decodes, some with a prompt chunk."""
    num_prefill = rng.choice([0, 0, rng.randint(1, 2048)])
    num_decode = rng.randint(0, 64)
    num_context = num_decode * rng.randint(1, 4096) + attended(num_prefill, rng.randint(0, 4000))
    num_verify = rng.randint(0, num_decode)
    return StepShape(num_prefill, num_decode, num_context, num_verify, int(num_prefill > 0))


def _seconds(shape: StepShape, slowdown: float = 1.0) -> float:
    return slowdown * sum(c * x for c, x in zip(TRUE_COEFFICIENTS, shape.features()))


def test_the_fit_recovers_the_coefficients_of_measured_steps():
    model, rng = StepTimeModel(), random.Random(0)
    for _ in range(400):
        shape = _random_shape(rng)
        model.record(shape, _seconds(shape))
    for fitted, true in zip(model.coefficients, TRUE_COEFFICIENTS):
        assert fitted == pytest.approx(true, rel=0.1)
    assert model.relative_error < 0.02


def test_noisy_steps_are_predicted_within_the_noise():
    model, rng = StepTimeModel(), random.Random(0)
    for _ in range(400):
        shape = _random_shape(rng)
        model.record(shape, _seconds(shape) * rng.uniform(0.98, 1.02))
    assert model.relative_error < 0.05
    for _ in range(20):
        shape = _random_shape(rng)
        assert model.predict(shape) == pytest.approx(_seconds(shape), rel=0.05)


def test_the_model_follows_a_machine_that_gets_slower():
    model, rng = StepTimeModel(), random.Random(1)
    for _ in range(300):
        shape = _random_shape(rng)
        model.record(shape, _seconds(shape))
    for _ in range(400):
        shape = _random_shape(rng)
        model.record(shape, _seconds(shape, slowdown=2.0))
    for _ in range(20):
        shape = _random_shape(rng)
        assert model.predict(shape) == pytest.approx(_seconds(shape, slowdown=2.0), rel=0.05)


def test_the_coefficients_stay_non_negative():
    model = StepTimeModel()
    # Steps that get faster with more prompt tokens: a negative slope would fit them.
    for num_prefill in range(0, 2000, 10):
        model.record(StepShape(num_prefill, 8, 8 * 100), 0.05 - num_prefill * 1e-5)
    assert all(c >= 0 for c in model.coefficients)


def test_the_ratio_quantile_follows_the_steps_with_prompt_tokens():
    # Steps with prompt chunks vary log-normally around their time (sigma 0.3, as on a
    # 2-core server): the model keeps the P90 of measured / predicted.
    model, rng = StepTimeModel(), random.Random(2)
    model.coefficients = list(TRUE_COEFFICIENTS)
    ratios = []
    for i in range(400):
        shape = StepShape(rng.randint(1, 2048), rng.randint(0, 64), rng.randint(0, 10**6))
        if i < 15:
            assert model.ratio_quantile == 1.0  # too few steps yet: the mean prediction
        measured = rng.lognormvariate(0, 0.3) * _seconds(shape)
        ratios.append(measured / model.predict(shape))
        model.record(shape, measured)
    latest = sorted(ratios[-128:])
    # The P90 of the latest 128 (within one refit interval's lag).
    assert latest[106] <= model.ratio_quantile <= latest[124]
    assert 1.25 < model.ratio_quantile < 1.7  # exp(1.28 * 0.3) = 1.47
    # Decode-only steps do not count: the latency targets size the steps with prompts.
    decodes_only, decode = StepTimeModel(), StepShape(0, 32, 32 * 1000)
    for _ in range(100):
        decodes_only.record(decode, 2 * _seconds(decode))
    assert decodes_only.ratio_quantile == 1.0


def test_the_prior_comes_from_the_start_up_measurement():
    costs = [(n, 0.010 + n * 1e-4) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    intercept, per_prefill, per_decode, _, per_verify, _ = prior_from_step_costs(costs)
    assert intercept == pytest.approx(0.010, rel=1e-6)
    assert per_prefill == pytest.approx(0.1)  # 1e-4 s a token, per 1k tokens
    assert per_decode == per_verify == pytest.approx(0.01)  # per 100 rows
    model = StepTimeModel(costs)
    assert model.predict(StepShape(num_prefill_tokens=1000)) == pytest.approx(0.11, rel=0.01)
    assert StepTimeModel().coefficients != model.coefficients  # no measurement: the default


def test_the_shape_of_a_step_counts_prompt_tokens_decode_rows_and_attended_keys():
    scheduler = create_scheduler(max_num_batched_tokens=64)
    scheduler.add_request(create_request("decoding", num_tokens=10))
    step(scheduler)  # its prompt; it decodes from now on
    scheduler.add_request(create_request("prompt", num_tokens=100))
    scheduler_output = scheduler.schedule()
    shape = shape_of(scheduler_output)
    assert shape.num_decode_rows == 1
    assert shape.num_prefill_tokens == 63  # the budget less the decode
    # The decode's token attends its 10 computed tokens and itself; the chunk is causal.
    assert shape.num_context_tokens == 11 + 63 * 64 // 2
    assert shape.num_verify_rows == 0
    assert shape.num_prefill_chunks == 1


def test_the_model_knows_the_machine_after_its_first_measured_step():
    # The default prior is far from this machine (a GPU's guess, 10x too fast): the first
    # measured step refits at once, not after the regular interval's eight.
    model = StepTimeModel()
    shape = StepShape(num_prefill_tokens=2048, num_context_tokens=attended(2048, 0))
    measured = 10 * model.predict(shape)
    model.record(shape, measured)
    assert model.predict(shape) == pytest.approx(measured, rel=0.05)


def test_the_ratio_quantile_is_taken_under_the_current_fit():
    # Decode-only steps first: the fit learns them, and the prompt coefficient stays at the
    # prior (10x too fast here). Then steps with prompt chunks: those planned before the
    # next refit ran 10x their prediction, but the refit learns their cost, and the ratio
    # quantile is measured against it, not against the predictions those steps had.
    truth = [0.004, 1.0, 0.012, 0.020, 0.006, 0.0]
    model, rng = StepTimeModel(), random.Random(3)

    def measured(shape: StepShape) -> float:
        return sum(c * x for c, x in zip(truth, shape.features())) * rng.uniform(0.98, 1.02)

    for _ in range(8):
        decode = StepShape(0, rng.randint(1, 64), rng.randint(0, 10**5))
        model.record(decode, measured(decode))
    for _ in range(16):
        chunk = StepShape(rng.randint(64, 2048), rng.randint(1, 64), rng.randint(0, 10**6))
        model.record(chunk, measured(chunk))
    assert model.ratio_quantile < 1.2


def test_a_step_with_a_prompt_chunk_pays_for_leaving_the_decode_fast_path():
    # As on the CPU: 4 decodes take 55 ms on the native decode stack; a prompt chunk
    # sends the step to the module path, 100 ms more whatever its size, plus its tokens.
    def seconds(num_prefill: int) -> float:
        return 0.055 + (0.100 + 2e-4 * num_prefill if num_prefill else 0.0)

    def shape(num_prefill: int) -> StepShape:
        num_context = attended(num_prefill, 0) + 4 * 200
        return StepShape(num_prefill, 4, num_context, 0, int(num_prefill > 0))

    model, rng = StepTimeModel(), random.Random(4)
    for _ in range(300):
        num_prefill = rng.choice([0, 0, rng.randint(2, 512)])
        model.record(shape(num_prefill), seconds(num_prefill))
    for num_prefill in (0, 8, 64, 512):
        assert model.predict(shape(num_prefill)) == pytest.approx(seconds(num_prefill), rel=0.05)
