"""`kvserve bench latency`: how long one batch takes, end to end, in-process.

Mirrors `vllm bench latency`: one batch of --batch-size random-token prompts of --input-len
tokens, each generating exactly --output-len tokens (ignore_eos), run --num-iters-warmup times
unmeasured and --num-iters times measured. Unlike vLLM, the prefix cache is emptied before
every iteration: the prompts repeat, and a warm cache would measure decode alone.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

_PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_parser(kinds) -> None:
    from kvserve.shared.cli_args import add_struct_args
    from kvserve.shared.config import EngineConfig

    p = kinds.add_parser("latency", help="latency of one batch, offline (in-process engine)")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--num-iters-warmup", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=30)
    p.add_argument("--bench-seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument(
        "--output-json",
        "--save-result",
        dest="output_json",
        default=None,
        help="write the latencies and percentiles to this JSON file",
    )
    p.add_argument("--disable-tqdm", action="store_true")
    add_struct_args(p, EngineConfig, positional=("model",))
    p.set_defaults(func=run)


def latency_summary(latencies: list[float]) -> dict:
    """vLLM's latency JSON: avg_latency, latencies and percentiles {"10": s, ...}."""
    assert latencies, "at least one measured iteration"
    values = np.asarray(latencies)
    return {
        "avg_latency": float(values.mean()),
        "latencies": [float(x) for x in values],
        "percentiles": {str(p): float(np.percentile(values, p)) for p in _PERCENTILES},
    }


def run(args: argparse.Namespace) -> int:
    from kvserve import LLM, SamplingParams
    from kvserve.benchmarks.throughput import random_prompts
    from kvserve.shared.cli_args import struct_from_args
    from kvserve.shared.config import EngineConfig

    if args.batch_size < 1 or args.input_len < 1 or args.output_len < 1 or args.num_iters < 1:
        raise SystemExit(
            "kvserve bench latency: --batch-size, --input-len, --output-len and "
            "--num-iters must be >= 1"
        )
    llm = LLM.from_config(struct_from_args(EngineConfig, args))
    tokenizer = llm.get_tokenizer()
    prompts = random_prompts(
        args.batch_size,
        args.input_len,
        len(tokenizer),
        set(tokenizer.all_special_ids),
        args.bench_seed,
    )
    batch = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(
        n=args.n, max_tokens=args.output_len, ignore_eos=True, temperature=1.0, top_p=1.0
    )

    def run_once() -> float:
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - start

    iterations = range(args.num_iters_warmup + args.num_iters)
    if not args.disable_tqdm:
        from tqdm import tqdm

        iterations = tqdm(iterations, desc="Iterations (warm-up first)")
    latencies = [run_once() for _ in iterations][args.num_iters_warmup :]
    result = latency_summary(latencies)
    print(f"Avg latency: {result['avg_latency']} seconds")
    for p, value in result["percentiles"].items():
        print(f"{p}% percentile latency: {value} seconds")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=4)
    return 0
