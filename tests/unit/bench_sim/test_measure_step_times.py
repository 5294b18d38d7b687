"""The step-time fit of bench/measure_step_times.py, on synthetic steps (no model run)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.measure_step_times import fit_step_model


def _samples(intercept, per_prefill, per_decode_req, per_ctx, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    samples = []
    shapes = [
        (64, 0, 0),
        (1024, 0, 0),
        (2048, 0, 0),
        (0, 1, 130),
        (0, 32, 4000),
        (0, 64, 30000),
        (256, 8, 1000),
        (1024, 32, 8000),
    ]
    for index, (prefill, decode_reqs, ctx) in enumerate(shapes):
        for _ in range(3):
            seconds = (
                intercept + per_prefill * prefill + per_decode_req * decode_reqs + per_ctx * ctx
            ) * (1 + noise * rng.standard_normal())
            samples.append(
                {
                    "scenario": f"s{index}",
                    "seconds": seconds,
                    "num_prefill_tokens": prefill,
                    "num_decode_reqs": decode_reqs,
                    "num_decode_ctx_tokens": ctx,
                }
            )
    return samples


def test_fit_recovers_exact_coefficients():
    fit = fit_step_model(_samples(0.02, 5e-4, 2e-3, 1e-6))
    coef = fit["coefficients"]
    assert coef["intercept_s"] == pytest.approx(0.02, rel=1e-6)
    assert coef["num_prefill_tokens"] == pytest.approx(5e-4, rel=1e-6)
    assert coef["num_decode_reqs"] == pytest.approx(2e-3, rel=1e-6)
    assert coef["num_decode_ctx_tokens"] == pytest.approx(1e-6, rel=1e-6)
    assert fit["max_relative_error"] < 1e-6


def test_fit_never_keeps_a_negative_cost():
    # Decode requests that make steps cheaper: the term is dropped, not fitted negative.
    fit = fit_step_model(_samples(0.05, 5e-4, -5e-4, 1e-6))
    assert all(value >= 0 for value in fit["coefficients"].values())
    assert fit["coefficients"]["num_decode_reqs"] == 0.0
