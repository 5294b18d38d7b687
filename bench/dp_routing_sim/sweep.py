"""One run per (fleet size, router) on the same workload, and the calibration of the arrival
rate.

The arrival rate is set from a capacity: one simulated engine, the whole tenant mix queued at
t=0, run to completion; capacity = requests / makespan. That engine sees every tenant, as each
engine does under a prefix-blind router, so `load` = offered rate / (engines x capacity) is the
load a prefix-blind fleet carries; better prefix reuse makes the same rate a lighter load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bench.dp_routing_sim.engine import EngineConfig, StepTimeModel
from bench.dp_routing_sim.routers import make_router
from bench.dp_routing_sim.simulator import RunMetrics, make_engines, simulate, summarize
from bench.dp_routing_sim.workload import WorkloadConfig, make_requests
from kvserve.shared.hashing import HashAlgo, get_hash_fn


@dataclass(frozen=True)
class SweepConfig:
    """
    Args:
        engine_counts: fleet sizes to simulate.
        routers: router names.
        requests_per_engine: requests per run = this x engines (unless num_requests).
        num_requests: a fixed number of requests per run instead.
        load: offered load relative to the prefix-blind capacity (see module doc).
        warmup_frac: leading share of requests left out of the metrics (cold caches).
        refresh_s: load-table refresh period of the coordinator.
        prefix_slack: score slack of the prefix router; None keeps the shipped
            PREFIX_LOAD_SLACK (services/api/engine_client/dp_router.py).
        hash_algo: block hash of the engines and the router (the engines' default sha256).
        calibration_requests: requests queued on one engine to measure its capacity.
        seed: workload seed.
    """

    engine_counts: tuple[int, ...] = (8, 16, 32, 64)
    routers: tuple[str, ...] = ("load", "prefix", "round_robin")
    requests_per_engine: int = 250
    num_requests: int | None = None
    load: float = 0.7
    warmup_frac: float = 0.2
    refresh_s: float = 0.1
    prefix_slack: int | None = None
    hash_algo: HashAlgo = "sha256"
    calibration_requests: int = 400
    seed: int = 0


def engine_capacity(
    workload: WorkloadConfig, engine: EngineConfig, step_model: StepTimeModel, sweep: SweepConfig
) -> float:
    """Requests per second one engine completes with the tenant mix queued at t=0."""
    requests = make_requests(workload, sweep.calibration_requests, math.inf, sweep.seed, stream=1)
    hash_fn = get_hash_fn(sweep.hash_algo)
    engines = make_engines(1, engine, step_model, hash_fn)
    makespan = simulate(
        requests,
        engines,
        make_router("round_robin", 1, engine.num_blocks, engine.block_size, hash_fn),
    )
    return sweep.calibration_requests / makespan


def run_one(
    workload: WorkloadConfig,
    engine: EngineConfig,
    step_model: StepTimeModel,
    sweep: SweepConfig,
    num_engines: int,
    router_name: str,
    rate_per_s: float,
) -> RunMetrics:
    """One run; the workload depends only on the seed and the fleet size."""
    num_requests = sweep.num_requests or sweep.requests_per_engine * num_engines
    requests = make_requests(workload, num_requests, rate_per_s, sweep.seed)
    hash_fn = get_hash_fn(sweep.hash_algo)
    engines = make_engines(num_engines, engine, step_model, hash_fn)
    router = make_router(
        router_name, num_engines, engine.num_blocks, engine.block_size, hash_fn, sweep.prefix_slack
    )
    makespan = simulate(requests, engines, router, sweep.refresh_s)
    return summarize(
        requests, engines, router_name, rate_per_s, makespan, workload.block_size, sweep.warmup_frac
    )


def run_sweep(
    workload: WorkloadConfig, engine: EngineConfig, step_model: StepTimeModel, sweep: SweepConfig
) -> tuple[float, list[RunMetrics]]:
    """(per-engine capacity in req/s, one RunMetrics per fleet size and router)."""
    # Block 0 is the pool's null block: the rest hold tokens.
    if workload.max_request_tokens > (engine.num_blocks - 1) * engine.block_size:
        raise ValueError(
            f"a request of up to {workload.max_request_tokens} tokens does "
            f"not fit {engine.num_blocks - 1} blocks of {engine.block_size}; raise "
            f"--num-blocks or shorten the workload"
        )
    if not 0 < sweep.load:
        raise ValueError(f"load must be > 0, got {sweep.load}")
    if workload.block_size != engine.block_size:
        raise ValueError(
            f"the workload's block size {workload.block_size} differs from the "
            f"engines' {engine.block_size}"
        )
    capacity = engine_capacity(workload, engine, step_model, sweep)
    results = []
    for num_engines in sweep.engine_counts:
        rate = sweep.load * capacity * num_engines
        for router_name in sweep.routers:
            results.append(
                run_one(workload, engine, step_model, sweep, num_engines, router_name, rate)
            )
    return capacity, results


def format_table(results: list[RunMetrics]) -> str:
    """A markdown table, one row per run."""
    header = (
        "| engines | router | req/s | hit rate | ideal hit | TTFT mean s | TTFT P99 s "
        "| TPOT mean ms | busy skew | req skew | util | preempt |"
    )
    lines = [header, "|---" * 12 + "|"]
    for m in results:
        lines.append(
            f"| {m.num_engines} | {m.router} | {m.rate_per_s:.1f} | {m.hit_rate:.1%} "
            f"| {m.ideal_hit_rate:.1%} | {m.ttft_mean_s:.2f} | {m.ttft_p99_s:.2f} "
            f"| {m.tpot_mean_s * 1e3:.0f} | {m.busy_skew:.2f} | {m.req_skew:.2f} "
            f"| {m.utilization:.0%} | {m.num_preemptions} |"
        )
    return "\n".join(lines)
