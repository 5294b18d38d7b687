"""The default model's tokenizer, shared by the dataset and metric tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from kvserve.benchmarks.datasets import load_tokenizer

    return load_tokenizer(default_model_dir)
