"""The KV-cache budget: --gpu-memory-utilization is a share of the whole device."""

from __future__ import annotations

import pytest

from kvserve.services.worker.worker import Worker, kv_cache_budget
from kvserve.shared.config import EngineConfig
from tests.support.models import TINY_KV_CACHE_MEMORY

GiB = 1 << 30


def test_budget_is_the_share_of_the_whole_device_less_peak_and_non_torch():
    # 80 GiB card at 0.9 = 72 GiB; weights + activations peaked at 20, CUDA context 1.
    assert kv_cache_budget(80 * GiB, 0.9, 20 * GiB, 1 * GiB) == 51 * GiB
    # Nothing is left: zero blocks (the worker then names the flag to raise), not negative.
    assert kv_cache_budget(80 * GiB, 0.2, 20 * GiB, 1 * GiB) == 0
    # Memory freed by non-torch code since start-up cannot raise the budget.
    assert kv_cache_budget(10 * GiB, 0.5, 1 * GiB, -2 * GiB) == 4 * GiB


@pytest.mark.parametrize("utilization", [0.0, 1.5])
def test_budget_rejects_a_utilization_outside_0_1(utilization):
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        kv_cache_budget(GiB, utilization, 0, 0)


def test_profile_run_is_the_largest_step_without_a_cache(tiny_checkpoint):
    config = EngineConfig.from_kwargs(
        max_num_batched_tokens=96,
        max_num_seqs=5,
        max_model_len=64,
        kv_cache_memory=TINY_KV_CACHE_MEMORY,  # not the CPU default's 4 GiB, zero-filled
    )
    model_dir, _ = tiny_checkpoint("llama")
    worker = Worker(config, model_dir)
    worker.runner.profile_run()
    assert all(layer.kv_cache is None for layer in worker.runner.attention_layers)
    # The cache is sized after the profile as before, and a real step then runs on it.
    worker.initialize_kv_cache(worker.determine_num_blocks())
    assert worker.runner.kv_caches
