"""The DP routing simulator (bench/dp_routing_sim): it drives the shipped DPRouter and
KVCacheManager/BlockPool on real token ids; determinism, cache reuse, balance, a hand-checked
routing scenario, and preemption without leaks."""

from __future__ import annotations

import numpy as np
import pytest

from bench.dp_routing_sim.engine import EngineConfig, StepTimeModel
from bench.dp_routing_sim.routers import RoundRobinRouter, make_router
from bench.dp_routing_sim.simulator import make_engines, simulate
from bench.dp_routing_sim.sweep import SweepConfig, run_one
from bench.dp_routing_sim.workload import SimRequest, WorkloadConfig, make_requests
from kvserve.services.api.engine_client import dp_router
from kvserve.services.api.engine_client.dp_router import DPRouter
from kvserve.services.scheduler.core.block_pool import BlockPool
from kvserve.services.scheduler.core.kv_cache_manager import KVCacheManager
from kvserve.shared.hashing import get_hash_fn, hash_new_full_blocks

# A fixed model (not bench/step_times.json) so the tests do not move with a re-measurement.
STEP_MODEL = StepTimeModel(
    intercept_s=0.01, per_prefill_token_s=1e-4, per_decode_req_s=1e-3, per_decode_ctx_token_s=1e-6
)
ENGINE = EngineConfig(num_blocks=2048)
BLOCK_SIZE = ENGINE.block_size
HASH_FN = get_hash_fn("sha256")


def run(
    workload: WorkloadConfig,
    router: str,
    num_engines: int = 8,
    num_requests: int = 400,
    rate_per_s: float = 20.0,
    seed: int = 0,
):
    sweep = SweepConfig(num_requests=num_requests, seed=seed, warmup_frac=0.0)
    return run_one(workload, ENGINE, STEP_MODEL, sweep, num_engines, router, rate_per_s)


def test_load_and_prefix_are_the_shipped_router_and_engines_the_shipped_cache():
    for name in ("load", "prefix"):
        router = make_router(name, 4, 64, BLOCK_SIZE, HASH_FN)
        assert type(router) is DPRouter
        assert router.routing == name and router.engine_indices == [0, 1, 2, 3]
        assert router.prefix_slack == dp_router.PREFIX_LOAD_SLACK
    assert make_router("prefix", 4, 64, BLOCK_SIZE, HASH_FN).hash_fn is HASH_FN
    assert make_router("load", 4, 64, BLOCK_SIZE, HASH_FN).hash_fn is None  # as the api
    assert type(make_router("round_robin", 4, 64, BLOCK_SIZE, HASH_FN)) is RoundRobinRouter
    engine = make_engines(1, ENGINE, STEP_MODEL, HASH_FN)[0]
    assert type(engine.kv_cache_manager) is KVCacheManager
    assert type(engine.kv_cache_manager.block_pool) is BlockPool
    assert engine.kv_cache_manager.num_total_blocks == ENGINE.num_blocks - 1


def test_workload_token_ids_give_shared_prefix_chains_only():
    workload = WorkloadConfig(num_tenants=2, prefix_len_range=(100, 100))
    requests = make_requests(workload, 40, rate_per_s=1.0, seed=0)
    by_tenant = {}
    for request in requests:
        request.materialize()
        hashes = hash_new_full_blocks(HASH_FN, BLOCK_SIZE, request.prompt_token_ids, [])
        by_tenant.setdefault(request.tenant, []).append(hashes)
        assert len(request.token_ids) == request.prompt_len + request.output_len
    (first_a, *rest_a), (first_b, *_) = by_tenant.values()
    # 100 // 16 = 6 prefix blocks shared within a tenant; block 6 holds suffix tokens.
    for hashes in rest_a:
        assert hashes[:6] == first_a[:6] and hashes[6] != first_a[6]
    assert not set(first_a) & set(first_b)
    all_hashes = [h for chains in by_tenant.values() for chain in chains for h in chain[6:]]
    assert len(all_hashes) == len(set(all_hashes))  # suffix blocks are never shared


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
    assert metrics.hit_rate == 0.0


def test_load_router_balances_uniform_traffic():
    workload = WorkloadConfig(
        num_tenants=64,
        prefix_len_range=(0, 0),
        suffix_len_range=(256, 256),
        output_len_range=(64, 64),
    )
    metrics = run(workload, "load", num_requests=800, rate_per_s=40.0)
    assert metrics.req_skew <= 1.1, metrics
    assert metrics.busy_skew <= 1.1, metrics


def _burst(tenants: str) -> list[SimRequest]:
    """One request per letter, 1 ms apart (all inside one load-table period); 96-token
    prompts = 4 blocks of the tenant's prefix + 2 blocks of its own."""
    rng = np.random.default_rng(0)
    prefixes = {t: rng.integers(0, 1000, 64, dtype=np.int32) for t in sorted(set(tenants))}
    return [
        SimRequest(
            req_idx,
            req_idx * 1e-3,
            ord(tenant),
            prefixes[tenant],
            np.arange(36, dtype=np.int32) + 1000 * (req_idx + 1),
            96,
            4,
        )
        for req_idx, tenant in enumerate(tenants)
    ]


def _simulate(
    requests: list[SimRequest], router: str, num_engines: int = 2, prefix_slack: int | None = None
):
    engines = make_engines(num_engines, EngineConfig(num_blocks=64), STEP_MODEL, HASH_FN)
    simulate(
        requests, engines, make_router(router, num_engines, 64, BLOCK_SIZE, HASH_FN, prefix_slack)
    )
    return engines


@pytest.mark.parametrize(
    "router, expected_engines, expected_cached",
    [
        # load: score 4 x waiting + running with the local bump: 0 -> e0; [4, 0] -> e1;
        # [4, 4] is a tie, which goes round-robin after e1: e0.
        ("load", [0, 1, 0], [0, 0, 0]),
        # prefix: the second A follows the first (score 4 <= 0 + slack 8) and hits its 4
        # prefix blocks; B has no prefix anywhere and falls back to the lowest score, e1.
        ("prefix", [0, 0, 1], [0, 64, 0]),
        ("round_robin", [0, 1, 0], [0, 0, 0]),
    ],
)
def test_two_engines_three_requests(router, expected_engines, expected_cached):
    requests = _burst("AAB")
    engines = _simulate(requests, router)
    assert [r.engine_idx for r in requests] == expected_engines
    assert [r.num_cached_tokens for r in requests] == expected_cached
    assert all(r.num_output == r.output_len for r in requests)
    # The first step is req 0's whole prompt: 0.01 + 96 x 1e-4 s.
    assert requests[0].first_token_s == pytest.approx(0.01 + 96e-4)
    # Tenant A's prefix stays cached in the BlockPool of every engine that ran A, under
    # the hash shared/hashing.py gives it.
    requests[0].materialize()
    a_hashes = hash_new_full_blocks(HASH_FN, BLOCK_SIZE, requests[0].prompt_token_ids, [])
    for engine in engines:
        pool = engine.kv_cache_manager.block_pool
        ran_a = engine.engine_idx in expected_engines[:2]
        assert (pool.get_cached_block(a_hashes[3]) is not None) == ran_a
        # Every block is back in the free queue.
        assert engine.kv_cache_manager.num_free_blocks == pool.num_blocks - 1
        assert not engine.kv_cache_manager.req_to_blocks


def test_the_simulator_follows_the_shipped_prefix_slack(monkeypatch):
    # Six A's in one table period. With the shipped slack of 8, the holder e0 yields once its
    # bumped score (4, 8, 12 before the 2nd..4th) passes e1's 0 + 8: the 4th goes to e1, and
    # once both hold A the less loaded one wins.
    requests = _burst("AAAAAA")
    _simulate(requests, "prefix")
    assert dp_router.PREFIX_LOAD_SLACK == 8
    assert [r.engine_idx for r in requests] == [0, 0, 0, 1, 1, 1]
    # With the shipped constant at 16, e0 takes them up to score 16.
    monkeypatch.setattr(dp_router, "PREFIX_LOAD_SLACK", 16)
    requests = _burst("AAAAAA")
    _simulate(requests, "prefix")
    assert [r.engine_idx for r in requests] == [0, 0, 0, 0, 0, 1]


@pytest.mark.parametrize("slack, expected_req_skew", [(10**6, 8.0), (0, None)])
def test_a_sweep_run_reads_the_shipped_prefix_slack(monkeypatch, slack, expected_req_skew):
    monkeypatch.setattr(dp_router, "PREFIX_LOAD_SLACK", slack)
    workload = WorkloadConfig(num_tenants=1, prefix_len_range=(512, 512))
    metrics = run(workload, "prefix", num_requests=120, rate_per_s=8.0)
    if expected_req_skew is not None:
        assert metrics.req_skew == expected_req_skew  # one tenant, one engine
    else:
        assert metrics.req_skew < 1.5  # no slack: the load rule alone spreads it


def test_the_simulator_calls_dp_router_choose_with_the_prompt(monkeypatch):
    seen = []
    choose = DPRouter.choose

    def spy(self, prompt_token_ids, *args, **kwargs):
        seen.append(np.array(prompt_token_ids))
        return choose(self, prompt_token_ids, *args, **kwargs)

    monkeypatch.setattr(DPRouter, "choose", spy)
    requests = _burst("AB")
    _simulate(requests, "prefix")
    assert len(seen) == 2
    for prompt, request in zip(seen, requests):
        assert prompt.tolist() == (
            request.prefix_token_ids.tolist() + request.own_token_ids[:32].tolist()
        )


@pytest.mark.parametrize("output_len", [22, 23, 24])
def test_every_block_with_kv_is_cached_outputs_too(output_len):
    # 90 prompt tokens + 23 outputs: the last output is sampled, never computed, so 112
    # tokens have KV = 7 full blocks, the 7th filled by the last decode step (22 and 24:
    # the last step fills no block).
    request = SimRequest(
        0,
        0.0,
        0,
        np.arange(64, dtype=np.int32),
        np.arange(26 + output_len, dtype=np.int32) + 1000,
        90,
        output_len,
    )
    engine = _simulate([request], "load", num_engines=1)[0]
    request.materialize()
    num_kv_tokens = request.prompt_len + output_len - 1
    hashes = hash_new_full_blocks(HASH_FN, BLOCK_SIZE, request.token_ids[:num_kv_tokens], [])
    pool = engine.kv_cache_manager.block_pool
    assert len(hashes) == num_kv_tokens // BLOCK_SIZE
    assert all(pool.get_cached_block(h) is not None for h in hashes)
    assert len(pool.cached_block_hash_to_block) == len(hashes)


def test_tight_kv_preempts_and_still_finishes_without_leaks():
    # 160 blocks hold ~3 requests of up to ~50 blocks: the batch must preempt to grow.
    workload = WorkloadConfig(
        num_tenants=4,
        prefix_len_range=(256, 512),
        suffix_len_range=(64, 128),
        output_len_range=(64, 160),
    )
    requests = make_requests(workload, 60, rate_per_s=50.0, seed=3)
    engines = make_engines(1, EngineConfig(num_blocks=160), STEP_MODEL, HASH_FN)
    simulate(requests, engines, make_router("load", 1, 160, BLOCK_SIZE, HASH_FN))
    assert engines[0].num_preemptions > 0
    assert all(r.num_output == r.output_len and r.finish_s >= r.first_token_s for r in requests)
    assert all(r.token_ids is None and not r.block_hashes for r in requests)
    manager = engines[0].kv_cache_manager
    assert manager.num_free_blocks == manager.num_total_blocks
    assert not manager.req_to_blocks and not manager.num_cached_block
    free_blocks = manager.block_pool.free_block_queue.get_all_free_blocks()
    assert all(block.ref_cnt == 0 for block in free_blocks)
    assert len(free_blocks) == manager.num_total_blocks
