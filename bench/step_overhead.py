"""What async scheduling could hide: the engine core's own time per step, beside the forward.

Async scheduling (vLLM's `--async-scheduling`) overlaps the scheduler's work for step N+1
with step N's forward, so at most it saves the time an engine step spends outside
`execute_model`: `schedule()`, `update_from_output()` and the step's stats. This script runs
the real default model in-process through `kvserve.LLM` (the shipped EngineCore, scheduler and
worker), with `--max-num-seqs` requests in flight as at concurrency 32, times each of those
calls in every step, and prints their means and their share of the step.

    .venv/bin/python bench/step_overhead.py --dtype bfloat16 --num-prompts 64

The timers wrap the engine core's own bound methods; nothing is re-implemented.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections import defaultdict

import numpy as np

from kvserve.llm import LLM
from kvserve.shared.sampling_params import SamplingParams

VOCAB_LOW, VOCAB_HIGH = 100, 40000  # plain (non-special) token ids of SmolLM2


def _timed(totals: dict[str, float], name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start

    return wrapper


def measure(args: argparse.Namespace) -> dict:
    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=False,
        max_model_len=2048,
    )
    core = llm.engine_core
    totals: dict[str, float] = defaultdict(float)
    core.scheduler.schedule = _timed(totals, "schedule", core.scheduler.schedule)
    core.scheduler.update_from_output = _timed(
        totals, "update_from_output", core.scheduler.update_from_output
    )
    core.scheduler.make_stats = _timed(totals, "make_stats", core.scheduler.make_stats)
    core.executor.execute_model = _timed(totals, "execute_model", core.executor.execute_model)
    steps = 0
    step = core.step

    @functools.wraps(step)
    def counted_step():
        nonlocal steps
        steps += 1
        return step()

    core.step = _timed(totals, "step", counted_step)
    rng = np.random.default_rng(0)
    prompts = [
        {"prompt_token_ids": rng.integers(VOCAB_LOW, VOCAB_HIGH, args.input_len).tolist()}
        for _ in range(args.num_prompts)
    ]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=1.0)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    overlappable = totals["schedule"] + totals["update_from_output"] + totals["make_stats"]
    return {
        "dtype": args.dtype,
        "steps": steps,
        "wall_s": wall,
        "ms_per_step": {name: 1000 * value / steps for name, value in totals.items()},
        "engine_core_outside_forward_share": overlappable / totals["step"],
        "outside_engine_step_share": (wall - totals["step"]) / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the packaged SmolLM2-135M")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--save-result", default=None, help="also write the figures as JSON")
    args = parser.parse_args()
    result = measure(args)
    for name, ms in sorted(result["ms_per_step"].items()):
        print(f"{name:<20} {ms:8.3f} ms/step")
    print(f"steps: {result['steps']}, wall {result['wall_s']:.1f} s")
    print(
        "schedule + update_from_output + make_stats: "
        f"{100 * result['engine_core_outside_forward_share']:.2f} % of the engine step "
        "(the most async scheduling can hide)"
    )
    print(
        "outside the engine step (offline output processing; the api process when serving): "
        f"{100 * result['outside_engine_step_share']:.2f} % of the wall time"
    )
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
