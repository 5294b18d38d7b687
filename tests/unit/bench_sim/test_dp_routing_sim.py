"""The DP routing simulator (bench/dp_routing_sim): determinism, cache reuse, balance, and a
hand-checked routing scenario."""

from __future__ import annotations

import pytest

from bench.dp_routing_sim.engine import EngineConfig, StepTimeModel
from bench.dp_routing_sim.routers import make_router
from bench.dp_routing_sim.simulator import make_engines, simulate
from bench.dp_routing_sim.sweep import SweepConfig, run_one
from bench.dp_routing_sim.workload import SimRequest, WorkloadConfig, make_requests

# A fixed model (not bench/step_times.json) so the tests do not move with a re-measurement.
STEP_MODEL = StepTimeModel(intercept_s=0.01, per_prefill_token_s=1e-4,
                           per_decode_req_s=1e-3, per_decode_ctx_token_s=1e-6)
ENGINE = EngineConfig(num_blocks=2048)


def run(workload: WorkloadConfig, router: str, num_engines: int = 8,
        num_requests: int = 400, rate_per_s: float = 20.0, seed: int = 0):
    sweep = SweepConfig(num_requests=num_requests, seed=seed, warmup_frac=0.0)
    return run_one(workload, ENGINE, STEP_MODEL, sweep, num_engines, router, rate_per_s)


def test_same_seed_same_result():
    workload = WorkloadConfig(num_tenants=16)
    first = run(workload, "prefix", num_requests=200)
    assert run(workload, "prefix", num_requests=200) == first
    assert run(workload, "prefix", num_requests=200, seed=1) != first


def test_one_tenant_prefix_router_near_ideal_and_above_round_robin():
    workload = WorkloadConfig(num_tenants=1, prefix_len_range=(1024, 1024))
    # A light load: one or two engines can carry the tenant, so the prefix router keeps it
    # on few engines while round robin cold-starts it on all eight.
    prefix = run(workload, "prefix", rate_per_s=4.0)
    round_robin = run(workload, "round_robin", rate_per_s=4.0)
    assert prefix.ideal_hit_rate > 0.6
    assert prefix.hit_rate >= 0.98 * prefix.ideal_hit_rate
    assert prefix.hit_rate > round_robin.hit_rate


@pytest.mark.parametrize("router", ["load", "prefix", "round_robin"])
def test_no_shared_prefix_no_hits(router):
    workload = WorkloadConfig(num_tenants=32, prefix_len_range=(0, 0))
    metrics = run(workload, router, num_requests=200)
    assert metrics.ideal_hit_rate == 0.0
    assert metrics.hit_rate < 0.001


def test_load_router_balances_uniform_traffic():
    workload = WorkloadConfig(num_tenants=64, prefix_len_range=(0, 0),
                              suffix_len_range=(256, 256), output_len_range=(64, 64))
    metrics = run(workload, "load", num_requests=800, rate_per_s=40.0)
    assert metrics.req_skew <= 1.1, metrics
    assert metrics.busy_skew <= 1.1, metrics


def _hand_requests() -> list[SimRequest]:
    """Tenant A, A, B within one refresh period; 96-token prompts = 4 shared + 2 own
    blocks each."""
    shared = {"A": [100, 101, 102, 103], "B": [200, 201, 202, 203]}
    requests = []
    for req_idx, (arrival_s, tenant) in enumerate([(0.0, "A"), (0.001, "A"),
                                                   (0.002, "B")]):
        own = [-(10 * req_idx + 1), -(10 * req_idx + 2)]
        requests.append(SimRequest(req_idx, arrival_s, ord(tenant), 96, 4,
                                   shared[tenant] + own))
    return requests


@pytest.mark.parametrize("router, expected_engines, expected_cached", [
    # load: 4 x waiting + running with the local bump: 0 -> e0, [4, 0] -> e1, [4, 4] -> e0.
    ("load", [0, 1, 0], [0, 0, 0]),
    # prefix: the second A follows the first (score 4 <= 0 + slack 8) and hits its 4 shared
    # blocks; B has no prefix anywhere and falls back to the lowest score, e1.
    ("prefix", [0, 0, 1], [0, 64, 0]),
    ("round_robin", [0, 1, 0], [0, 0, 0]),
])
def test_two_engines_three_requests(router, expected_engines, expected_cached):
    requests = _hand_requests()
    engines = make_engines(2, EngineConfig(num_blocks=64), STEP_MODEL)
    simulate(requests, engines, make_router(router, 2, record_blocks=64, prefix_slack=8))
    assert [r.engine_idx for r in requests] == expected_engines
    assert [r.num_cached_tokens for r in requests] == expected_cached
    assert all(r.num_output == r.output_len for r in requests)
    # The first step is req 0's whole prompt: 0.01 + 96 x 1e-4 s.
    assert requests[0].first_token_s == pytest.approx(0.01 + 96e-4)
    # Every block is back: used 0, and the cached ones sit in the free LRU.
    assert all(e.cache.num_used == 0 for e in engines)


def test_tight_kv_preempts_and_still_finishes_without_leaks():
    # 160 blocks hold ~3 requests of up to ~50 blocks: the batch must preempt to grow.
    workload = WorkloadConfig(num_tenants=4, prefix_len_range=(256, 512),
                              suffix_len_range=(64, 128), output_len_range=(64, 160))
    requests = make_requests(workload, 60, rate_per_s=50.0, seed=3)
    engines = make_engines(1, EngineConfig(num_blocks=160), STEP_MODEL)
    simulate(requests, engines, make_router("load", 1, record_blocks=160, prefix_slack=8))
    assert engines[0].num_preemptions > 0
    assert all(r.num_output == r.output_len and r.finish_s >= r.first_token_s
               for r in requests)
    cache = engines[0].cache
    assert cache.num_used == 0 and not cache.ref_counts
    assert cache.num_never_used + sum(cache.free_lru.values()) == cache.num_blocks
