"""Fixtures shared by every test folder (helper functions live in tests/support)."""

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


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A tiny random Llama folder (tests.support.models.build_tiny_llama), written once; the
    process tests serve it, since it starts in seconds."""
    from tests.support.models import build_tiny_llama

    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))
