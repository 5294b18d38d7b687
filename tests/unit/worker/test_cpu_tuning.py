"""The engine's CPU GEMM plan at start-up (services/worker/cpu_tuning.py): timed with
--cpu-gemm auto, untimed on torch's path under KVSERVE_CPU_GEMM_MEASURE=0 (the suite's
setting, tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from kvserve.services.worker.cpu_tuning import prepare_gemm
from kvserve.services.worker.models import load_model
from kvserve.shared.config import EngineConfig


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir, torch.float32, "cpu")
    return model


def test_measure_off_runs_every_layer_on_torch_untimed(tiny_model, monkeypatch):
    monkeypatch.setenv("KVSERVE_CPU_GEMM_MEASURE", "0")
    plan = prepare_gemm(tiny_model, EngineConfig())
    assert plan.source == "forced" and plan.shapes
    assert all(set(shape.paths) == {"torch"} for shape in plan.shapes.values())


def test_measure_on_times_the_shapes(tiny_model, monkeypatch, tmp_path):
    monkeypatch.setenv("KVSERVE_CPU_GEMM_MEASURE", "1")
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))  # nothing cached yet
    assert prepare_gemm(tiny_model, EngineConfig()).source == "measured"
