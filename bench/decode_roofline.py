"""Batch-1 decode against the machine's memory bound: read bandwidth, TPOT, weight bytes.

A batch-1 decode step reads every weight once, so weight bytes / read bandwidth is the
fastest a step can be. This script measures:

1. the read bandwidth, STREAM-like: a 512 MiB float32 tensor summed (torch, one and all
   threads), best of several passes;
2. the batch-1 TPOT of the default model through the shipped `kvserve.LLM` (one request,
   INPUT_LEN random tokens in, OUTPUT_LEN out, ignore_eos; --batch N: N such requests at once,
   so each decode step has N rows and the bound is no longer the weights) per dtype and per
   setting of KVSERVE_NATIVE_DECODE_ROWS (16: the native decode stack, 0: the module path),
   each in its own process, the settings interleaved over ROUNDS rounds (A B A B);
3. the weight bytes a step reads (every linear weight plus the LM head) and the bound they give.

    .venv/bin/python bench/decode_roofline.py --rounds 3
    .venv/bin/python bench/decode_roofline.py --dtypes float32 --quantization gguf
    .venv/bin/python bench/decode_roofline.py --batch 16 --rows 32,0 --output-len 64

Prints one JSON line per run and a table of medians (with the range over rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch


def read_bandwidth_gbs(threads: int, mib: int = 512, passes: int = 7) -> float:
    torch.set_num_threads(threads)
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    x.sum()  # first touch
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def child(args: argparse.Namespace) -> None:
    """One measurement in this process: prints a JSON line."""
    import numpy as np

    from kvserve.llm import LLM
    from kvserve.services.worker.quantization import weight_bytes
    from kvserve.shared import env
    from kvserve.shared.sampling_params import SamplingParams

    kwargs = dict(dtype=args.dtype, max_model_len=1024, kv_cache_memory=256 << 20)
    if args.quantization:
        kwargs["quantization"] = args.quantization
    llm = LLM(**kwargs)
    rng = np.random.default_rng(0)
    prompts = [
        {"prompt_token_ids": rng.integers(100, 40000, args.input_len).tolist()}
        for _ in range(args.batch)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    first = SamplingParams(temperature=0.0, max_tokens=1)

    def seconds(sampling: SamplingParams) -> float:
        start = time.perf_counter()
        llm.generate(prompts, sampling, use_tqdm=False)
        return time.perf_counter() - start

    # TPOT: the whole batch less a one-token batch (its prefills), over the other steps.
    tpots = [
        (seconds(params) - seconds(first)) / (args.output_len - 1) for _ in range(args.repeats)
    ]
    model = llm.engine_core.executor.worker.runner.model  # the uni executor: in this process
    print(
        json.dumps(
            {
                "dtype": args.dtype,
                "quantization": args.quantization,
                "native_rows": env.NATIVE_DECODE_ROWS.get(),
                "batch": args.batch,
                "tpot_ms": min(tpots) * 1e3,
                # Every weight once (the default model's LM head is its tied embedding).
                "weight_bytes": weight_bytes(model),
            }
        ),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rows", default="16,0", help="KVSERVE_NATIVE_DECODE_ROWS settings")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="requests per process (best)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--batch", type=int, default=1, help="requests at once: decode steps of this many rows"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    cores = len(os.sched_getaffinity(0))
    bandwidth = {t: read_bandwidth_gbs(t) for t in sorted({1, cores})}
    print(json.dumps({"read_bandwidth_gbs": bandwidth}), flush=True)
    runs: dict[tuple[str, int], list[dict]] = {}
    for _ in range(args.rounds):
        for dtype in args.dtypes.split(","):
            for rows in map(int, args.rows.split(",")):
                command = [sys.executable, __file__, "--child", "--dtype", dtype]
                command += [
                    "--input-len",
                    str(args.input_len),
                    "--output-len",
                    str(args.output_len),
                ]
                command += ["--repeats", str(args.repeats), "--batch", str(args.batch)]
                if args.quantization:
                    command += ["--quantization", args.quantization]
                env = dict(os.environ, KVSERVE_NATIVE_DECODE_ROWS=str(rows))
                out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
                result = json.loads(out.stdout.strip().splitlines()[-1])
                print(json.dumps(result), flush=True)
                runs.setdefault((dtype, rows), []).append(result)
    best_bw = max(bandwidth.values())
    print(
        f"\nread bandwidth: {', '.join(f'{t} threads {b:.1f} GB/s' for t, b in bandwidth.items())}"
    )
    print("| dtype | native rows | TPOT ms (median, range) | weight MB | bound ms | TPOT / bound |")
    print("|---|---|---|---|---|---|")
    for (dtype, rows), results in runs.items():
        tpots = [r["tpot_ms"] for r in results]
        weight = results[0]["weight_bytes"]
        bound = weight / (best_bw * 1e9) * 1e3
        median = statistics.median(tpots)
        print(
            f"| {dtype}{' ' + args.quantization if args.quantization else ''} | {rows} | "
            f"{median:.1f} ({min(tpots):.1f}-{max(tpots):.1f}) | {weight / 1e6:.0f} | "
            f"{bound:.1f} | {median / bound:.2f}x |"
        )


if __name__ == "__main__":
    main()
