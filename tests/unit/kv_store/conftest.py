"""Fixtures of the KV store tests (helpers: tests/support/kv_store.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvserve.shared.messages import KvFingerprint
from tests.support.kv_store import StoreProcess, tiny_fingerprint


@pytest.fixture
def start_store() -> Iterator[Callable[..., StoreProcess]]:
    """start_store(*flags) -> a running StoreProcess; every one is stopped at teardown."""
    started: list[StoreProcess] = []

    def start(*args: str) -> StoreProcess:
        started.append(StoreProcess(*args))
        return started[-1]

    yield start
    for store in started:
        store.stop()


@pytest.fixture
def fingerprint() -> KvFingerprint:
    return tiny_fingerprint()
