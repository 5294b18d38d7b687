"""shared/env.py: a hung budget shorter than the heartbeat timeout it follows is refused; a
step-cost table reads as (tokens, seconds) pairs."""

from __future__ import annotations

import pytest

from kvserve.shared.env import (
    ENGINE_HEARTBEAT_TIMEOUT_S,
    ENGINE_HUNG_TIMEOUT_S,
    SPEC_STEP_COSTS,
    WORKER_HEARTBEAT_TIMEOUT_S,
    WORKER_HUNG_TIMEOUT_S,
    read_hung_timeout_s,
)


def test_the_hung_budgets_default_to_30s_past_their_heartbeat_timeouts(monkeypatch):
    for var in (
        ENGINE_HEARTBEAT_TIMEOUT_S,
        ENGINE_HUNG_TIMEOUT_S,
        WORKER_HEARTBEAT_TIMEOUT_S,
        WORKER_HUNG_TIMEOUT_S,
    ):
        monkeypatch.delenv(var.name, raising=False)
    assert read_hung_timeout_s(ENGINE_HUNG_TIMEOUT_S, ENGINE_HEARTBEAT_TIMEOUT_S) == 30.0
    assert read_hung_timeout_s(WORKER_HUNG_TIMEOUT_S, WORKER_HEARTBEAT_TIMEOUT_S) == 30.0


def test_a_hung_budget_may_equal_the_heartbeat_timeout_but_not_undercut_it(monkeypatch):
    monkeypatch.setenv(ENGINE_HEARTBEAT_TIMEOUT_S.name, "5")
    monkeypatch.setenv(ENGINE_HUNG_TIMEOUT_S.name, "5")
    assert read_hung_timeout_s(ENGINE_HUNG_TIMEOUT_S, ENGINE_HEARTBEAT_TIMEOUT_S) == 5.0
    monkeypatch.setenv(ENGINE_HUNG_TIMEOUT_S.name, "4")
    with pytest.raises(
        ValueError,
        match="KVSERVE_ENGINE_HUNG_TIMEOUT_S=4 is shorter than "
        "KVSERVE_ENGINE_HEARTBEAT_TIMEOUT_S=5.*raise KVSERVE_ENGINE_HUNG_TIMEOUT_S",
    ):
        read_hung_timeout_s(ENGINE_HUNG_TIMEOUT_S, ENGINE_HEARTBEAT_TIMEOUT_S)
    monkeypatch.setenv(ENGINE_HUNG_TIMEOUT_S.name, "0")
    with pytest.raises(ValueError, match="must be > 0"):
        read_hung_timeout_s(ENGINE_HUNG_TIMEOUT_S, ENGINE_HEARTBEAT_TIMEOUT_S)


def test_the_step_cost_table_reads_as_pairs_and_refuses_a_malformed_one(monkeypatch):
    monkeypatch.delenv(SPEC_STEP_COSTS.name, raising=False)
    assert SPEC_STEP_COSTS.get() is None  # unset: the workers time the steps
    monkeypatch.setenv(SPEC_STEP_COSTS.name, "1:0.02, 8:0.025,64:0.09")
    assert SPEC_STEP_COSTS.get() == [(1, 0.02), (8, 0.025), (64, 0.09)]
    for bad in ("1:0.02,8", "0:0.02", "1:-1", "a:b"):
        monkeypatch.setenv(SPEC_STEP_COSTS.name, bad)
        with pytest.raises(ValueError, match="KVSERVE_SPEC_STEP_COSTS"):
            SPEC_STEP_COSTS.get()
