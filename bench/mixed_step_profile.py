"""Where a mixed step's time goes: the torch profiler over the concurrency-32 workload's step of 32
decode rows plus prefill chunks up to the token budget.

Runs the default model in-process through the shipped `kvserve.LLM` (its EngineCore, scheduler
and worker; prefix caching off): 32 requests of INPUT_LEN random tokens are prefilled until all
32 decode, then `--new-prompts` more of INPUT_LEN are added, so the next steps hold 32 decode
rows and prefill chunks up to `--max-num-batched-tokens` (2048, the default budget). Each of
`--steps` such steps runs under `torch.profiler` (CPU; its own cost is a few microseconds an op,
against steps of hundreds of milliseconds), timed by the clock too. The kernel dispatch points
(`kvserve.kernels`: norms, rotary, SiLU-and-mul, linear, paged attention, KV write, the
sampler's argmax) are wrapped in `record_function` ranges named `kvserve::<op>`, so the C
kernels that ctypes calls (which ATen does not see) are charged to their op: a range's self time
is its native kernel plus its Python, without the ATen ops inside it. The self CPU time is split
into GEMMs (torch's mm / addmm and oneDNN's packed linear), attention (the paged-attention ops),
the native ops, and the rest; the wall time nothing accounts for (the model's Python between
ops, the scheduler) is reported as such.

    .venv/bin/python bench/mixed_step_profile.py --dtype bfloat16
    .venv/bin/python bench/mixed_step_profile.py --dtype float32 --steps 3

Prints one JSON line per step and the top ops by self time of the last profiled step."""

from __future__ import annotations

import argparse
import functools
import json
import resource
import time

import numpy as np
from torch.profiler import ProfilerActivity, profile, record_function

from kvserve import kernels
from kvserve.kernels import dispatch
from kvserve.llm import LLM
from kvserve.shared.sampling_params import SamplingParams

VOCAB_LOW, VOCAB_HIGH = 100, 40000  # plain (non-special) token ids of SmolLM2
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise"}
ATTENTION_WORDS = ("attention", "flash", "sdpa")
LABELLED_OPS = (
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "rotary_write_kv_cache",
    "silu_and_mul",
    "linear",
    "write_kv_cache",
    "paged_attention",
    "argmax",
)


def _category(name: str) -> str:
    if name in GEMM_OPS:
        return "gemm"
    if any(word in name.lower() for word in ATTENTION_WORDS):
        return "attention"
    if name.startswith("kvserve::"):
        return "native"
    return "other"


def label_kernel_ops() -> None:
    """Wrap each dispatch point (where the model layers call it: `kvserve.kernels.<op>`) in a
    profiler range named kvserve::<op>."""

    def labelled(name, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            with record_function(f"kvserve::{name}"):
                return fn(*args, **kwargs)

        return call

    for name in LABELLED_OPS:
        setattr(kernels, name, labelled(name, getattr(dispatch, name)))


def _add(llm: LLM, rng: np.random.Generator, prefix: str, count: int, args) -> None:
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    for i in range(count):
        ids = rng.integers(VOCAB_LOW, VOCAB_HIGH, args.input_len).tolist()
        llm._add_request(f"{prefix}-{i}", None, ids, params, 0)


def measure(args: argparse.Namespace) -> list[dict]:
    label_kernel_ops()
    llm = LLM(
        dtype=args.dtype,
        max_num_seqs=64,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
        max_model_len=2048,
        kv_cache_memory=2 << 30,
    )
    core = llm.engine_core
    rng = np.random.default_rng(0)
    _add(llm, rng, "decode", 32, args)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running) or (
        core.scheduler.waiting
    ):
        core.step()
    results = []
    for step in range(args.steps):
        # Fresh prompts each step: the step holds every request that decodes (32, then more as
        # the previous step's prompts finish) and prefill chunks up to the token budget.
        decoding = sum(r.num_computed_tokens >= r.num_prompt_tokens for r in core.scheduler.running)
        _add(llm, rng, f"new-{step}", args.new_prompts, args)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            core.step()
            wall = time.perf_counter() - start
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        by_category = {"gemm": 0.0, "attention": 0.0, "native": 0.0, "other": 0.0}
        ops = prof.key_averages()
        for op in ops:
            by_category[_category(op.key)] += op.self_cpu_time_total / 1e6
        accounted = sum(by_category.values())
        results.append(
            {
                "dtype": args.dtype,
                "decode_rows": int(decoding),
                "step_ms": round(1e3 * wall, 1),
                "gemm_ms": round(1e3 * by_category["gemm"], 1),
                "attention_ms": round(1e3 * by_category["attention"], 1),
                "native_ops_ms": round(1e3 * by_category["native"], 1),
                "other_aten_ms": round(1e3 * by_category["other"], 1),
                "unaccounted_ms": round(1e3 * max(wall - accounted, 0.0), 1),
                "gemm_share_of_step": round(by_category["gemm"] / wall, 3),
                "page_faults": faults,
            }
        )
        print(json.dumps(results[-1]), flush=True)
        top = sorted(ops, key=lambda op: op.self_cpu_time_total, reverse=True)[: args.top]
        if args.verbose:
            shares = (f"{op.key} {op.self_cpu_time_total / 1e3:.1f}" for op in top[:9])
            print("  " + ", ".join(shares))
    print(f"top {args.top} ops by self CPU time, last profiled step:")
    for op in top:
        print(f"  {op.self_cpu_time_total / 1e3:9.1f} ms  {op.count:5d} calls  {op.key}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--new-prompts", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--verbose", action="store_true", help="the top ops of every step")
    args = parser.parse_args()
    measure(args)


if __name__ == "__main__":
    main()
