"""Fixtures shared by every test folder."""

from __future__ import annotations

import os

import pytest

# Two cores: keep torch from oversubscribing them when tests spawn processes.
os.environ.setdefault("OMP_NUM_THREADS", "2")

# Triton reads TRITON_INTERPRET when first imported, so it is set here, before any test module
# can import it: without a GPU the Triton kernel tests run in Triton's interpreter.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """The embedded SmolLM2-135M-Instruct, converted once into the cache folder."""
    from kvserve.services.worker.model_loader import resolve_model

    return resolve_model(None)


def assert_no_leaked_blocks(engine_core) -> None:
    """Every KV block is back in the free queue (cached blocks count as free)."""
    manager = engine_core.scheduler.kv_cache_manager
    assert not engine_core.scheduler.has_unfinished_requests()
    assert manager.num_free_blocks == manager.num_total_blocks, (
        f"{manager.num_total_blocks - manager.num_free_blocks} KV blocks leaked")
