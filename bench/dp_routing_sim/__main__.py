"""CLI: `python bench/dp_routing_sim [flags]` or `python -m bench.dp_routing_sim [flags]`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

if not __package__:  # run as `python bench/dp_routing_sim`: make `bench` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.dp_routing_sim.engine import EngineConfig, StepTimeModel
from bench.dp_routing_sim.routers import ROUTER_NAMES
from bench.dp_routing_sim.sweep import SweepConfig, format_table, run_sweep
from bench.dp_routing_sim.workload import WorkloadConfig

DEFAULT_STEP_TIMES = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "step_times.json"
)


def _range(text: str) -> tuple[int, int]:
    """'512-2048' -> (512, 2048); '256' -> (256, 256)."""
    low, _, high = text.partition("-")
    return int(low), int(high or low)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dp_routing_sim", description=__doc__)
    p.add_argument("--engines", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--routers", nargs="+", default=list(ROUTER_NAMES), choices=ROUTER_NAMES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests per run (default: --requests-per-engine x engines)",
    )
    p.add_argument("--requests-per-engine", type=int, default=250)
    p.add_argument("--tenants", type=int, default=128)
    p.add_argument(
        "--prefix-len",
        type=_range,
        default=(512, 2048),
        help="tenant prefix tokens, MIN-MAX (drawn per tenant)",
    )
    p.add_argument("--suffix-len", type=_range, default=(128, 384))
    p.add_argument("--output-len", type=_range, default=(64, 192))
    p.add_argument("--zipf", type=float, default=1.0, help="tenant popularity exponent")
    p.add_argument(
        "--load",
        type=float,
        default=0.7,
        help="offered load relative to one prefix-blind engine's capacity",
    )
    p.add_argument("--num-blocks", type=int, default=4096, help="KV blocks per engine")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument(
        "--refresh-s", type=float, default=0.1, help="coordinator load-table refresh period"
    )
    p.add_argument(
        "--prefix-slack",
        type=int,
        default=None,
        help="prefix router: max score above the lowest (4 x waiting + running); "
        "default: the shipped PREFIX_LOAD_SLACK",
    )
    p.add_argument(
        "--hash-algo",
        choices=("sha256", "xxhash"),
        default="sha256",
        help="block hash of the engines and the router",
    )
    p.add_argument("--warmup-frac", type=float, default=0.2)
    p.add_argument(
        "--step-times",
        default=DEFAULT_STEP_TIMES,
        help="step-time model JSON (bench/measure_step_times.py)",
    )
    p.add_argument("--save-result", default=None, help="write config and metrics as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    workload = WorkloadConfig(
        num_tenants=args.tenants,
        prefix_len_range=args.prefix_len,
        suffix_len_range=args.suffix_len,
        output_len_range=args.output_len,
        zipf_exponent=args.zipf,
    )
    engine = EngineConfig(
        num_blocks=args.num_blocks,
        block_size=workload.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
    )
    sweep = SweepConfig(
        engine_counts=tuple(args.engines),
        routers=tuple(args.routers),
        requests_per_engine=args.requests_per_engine,
        num_requests=args.requests,
        load=args.load,
        warmup_frac=args.warmup_frac,
        refresh_s=args.refresh_s,
        prefix_slack=args.prefix_slack,
        hash_algo=args.hash_algo,
        seed=args.seed,
    )
    step_model = StepTimeModel.from_json(args.step_times)
    started = time.perf_counter()
    capacity, results = run_sweep(workload, engine, step_model, sweep)
    wall_s = time.perf_counter() - started
    print(
        f"per-engine capacity {capacity:.3f} req/s (prefix-blind, one engine); "
        f"offered load {args.load:.0%}; step model {args.step_times}; {wall_s:.1f} s"
    )
    print(format_table(results))
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(
                {
                    "workload": dataclasses.asdict(workload),
                    "engine": dataclasses.asdict(engine),
                    "sweep": dataclasses.asdict(sweep),
                    "step_model": dataclasses.asdict(step_model),
                    "capacity_req_per_s": capacity,
                    "wall_s": wall_s,
                    "results": [dataclasses.asdict(m) for m in results],
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
