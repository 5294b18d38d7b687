"""What tensor / pipeline parallelism costs on this CPU: mean engine step time of the
default model, offline (`LLM`), per TP x PP layout.

    .venv/bin/python bench/tp_cost.py [--layouts 1x1:uni,1x1:mp,3x1,1x2] [--decode-steps 16]

Per layout it times (around the executor's execute_model, so scheduling is left out):
  - decode: steps of `--num-seqs` running requests, one new token each;
  - prefill: a step of one `--prefill-tokens`-token prompt.
and prints a markdown table. The default model has 9 heads, so TP = 2 does not split it:
its row says so instead of a time. All ranks share this host's cores (each rank gets
cores // ranks torch threads), so TP here measures the communication and the split's
overhead, not a speed-up from more hardware.
"""

from __future__ import annotations

import argparse
import statistics
import time

PROMPT_LEN = 16


def _prompts(num: int, length: int, offset: int) -> list[dict]:
    # Distinct ids per request, so the prefix cache shortens no prefill.
    return [
        {"prompt_token_ids": [1000 + (offset + i * 131 + j) % 30000 for j in range(length)]}
        for i in range(num)
    ]


class StepTimer:
    """Wraps an executor's execute_model: (scheduled tokens, scheduled requests, seconds)."""

    def __init__(self, executor):
        self.steps: list[tuple[int, int, float]] = []
        self._execute = executor.execute_model
        executor.execute_model = self

    def __call__(self, scheduler_output):
        start = time.perf_counter()
        out = self._execute(scheduler_output)
        self.steps.append(
            (
                scheduler_output.total_num_scheduled_tokens,
                len(scheduler_output.num_scheduled_tokens),
                time.perf_counter() - start,
            )
        )
        return out


def measure(
    layout: str, num_seqs: int, decode_steps: int, prefill_tokens: int, prefill_runs: int
) -> dict[str, float | str]:
    from kvserve import LLM, SamplingParams

    shape, _, executor = layout.partition(":")
    tp, pp = (int(n) for n in shape.split("x"))
    kwargs = dict(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        dtype="float32",
        max_num_seqs=max(num_seqs, 8),
        kv_cache_memory=512 << 20,
    )
    if executor:
        kwargs["distributed_executor_backend"] = executor
    start = time.perf_counter()
    try:
        llm = LLM(**kwargs)
    except ValueError as exc:
        return {"layout": layout, "error": str(exc).split(";")[0]}
    startup_s = time.perf_counter() - start
    try:
        timer = StepTimer(llm.engine_core.executor)
        warmup = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate(_prompts(4, PROMPT_LEN, 99_000), warmup, use_tqdm=False)

        timer.steps.clear()
        decode = SamplingParams(temperature=0.0, max_tokens=decode_steps + 1, ignore_eos=True)
        llm.generate(_prompts(num_seqs, PROMPT_LEN, 0), decode, use_tqdm=False)
        decode_s = [s for tokens, reqs, s in timer.steps if tokens == reqs == num_seqs]

        timer.steps.clear()
        one_token = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        for run in range(prefill_runs):
            llm.generate(_prompts(1, prefill_tokens, 50_000 + run), one_token, use_tqdm=False)
        prefill_s = [s for tokens, _, s in timer.steps if tokens == prefill_tokens]
    finally:
        llm.engine_core.shutdown()
    return {
        "layout": layout,
        "startup_s": startup_s,
        "decode_ms": 1000 * statistics.mean(decode_s),
        "num_decode": len(decode_s),
        "prefill_ms": 1000 * statistics.mean(prefill_s),
        "num_prefill": len(prefill_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--layouts", default="1x1:uni,1x1:mp,2x1,3x1,1x2", help="TPxPP[:executor], comma-separated"
    )
    parser.add_argument("--num-seqs", type=int, default=32, help="running requests in decode")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--prefill-runs", type=int, default=3)
    args = parser.parse_args()
    rows = [
        measure(layout, args.num_seqs, args.decode_steps, args.prefill_tokens, args.prefill_runs)
        for layout in args.layouts.split(",")
    ]
    print(
        f"\n| TP x PP (executor) | decode step, {args.num_seqs} seqs (ms) | "
        f"prefill step, {args.prefill_tokens} tokens (ms) | start-up (s) |"
    )
    print("|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['layout']} | - | - | {row['error']} |")
            continue
        print(
            f"| {row['layout']} | {row['decode_ms']:.1f} (n={row['num_decode']}) | "
            f"{row['prefill_ms']:.1f} (n={row['num_prefill']}) | {row['startup_s']:.1f} |"
        )


if __name__ == "__main__":
    main()
