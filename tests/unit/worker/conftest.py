"""Fixtures of the worker tests: tiny random HF checkpoints, a tiny GGUF, the real model."""

from __future__ import annotations

import os

import pytest

from tests.support.models import make_tiny_hf_model, saved_checkpoints, write_llama_gguf


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than 20 s (real model)")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """kind -> (folder saved with save_pretrained, the HF model it holds), built once."""
    return saved_checkpoints(tmp_path_factory, make_tiny_hf_model)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """quantize (bool) -> (path of a tiny llama GGUF, the HF model it was written from)."""
    cache = {}

    def get(quantize: bool):
        if quantize not in cache:
            model = make_tiny_hf_model("llama", seed=1)
            folder = tmp_path_factory.mktemp("gguf")
            path = os.path.join(folder, f"tiny-{'q8_0' if quantize else 'f32'}.gguf")
            write_llama_gguf(path, model, quantize)
            cache[quantize] = (path, model)
        return cache[quantize]

    return get


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory, default_model_dir):
    """The default model converted from its GGUF by this checkout's code (test_model_loader.py
    tests the conversion; other tests read default_model_dir). That is default_model_dir's
    folder where this session converted it (the user's cache held none at its start, as on a
    clean CI machine: the ~16 CPU s conversion runs once a run), else a fresh conversion in a
    cache folder of this test session, so a conversion an older checkout left in the user's
    cache is never what is tested."""
    from kvserve.services.worker.model_loader import resolve_model
    from tests.support.cache_dir import DEFAULT_MODEL_CONVERTED_HERE

    if os.environ.get(DEFAULT_MODEL_CONVERTED_HERE) == "1":
        return default_model_dir
    return resolve_model(None, cache_dir=str(tmp_path_factory.mktemp("kvserve-cache")))
