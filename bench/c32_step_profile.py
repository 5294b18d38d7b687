"""Where a concurrency-32 step's time goes, in the real engine (issue 51).

Drives the shipped engine in-process (`kvserve.LLM`: its EngineCore, Scheduler, model runner,
native decode stack, sampler) through the serving benchmark's workload: `--num-prompts`
random prompts of `--input-len` tokens, `--output-len` tokens each (ignore_eos, greedy unless
`--temperature`), at most `--concurrency` in flight: a finished request's seat goes to the
next prompt at once, as `vllm bench serve --max-concurrency 32` does. So the steps are the
serving run's: pure decodes of up to 32 rows, and decodes beside prefill chunks up to the
token budget (2,048) while new prompts start.

Every step is split into phases by wrapping the engine's own methods (bench only): schedule,
the runner's state update, input preparation (step_inputs.prepare_inputs), the forward
(native decode stack or the modules), the LM head (compute_logits), the sampling metadata,
the sampler, the rest of the runner's sampling (broadcast, append), update_from_output, and
the engine's Python between them. Times are this thread's CPU time (`time.thread_time`:
outside load does not inflate it; with one torch thread it is all the step's work) and wall
time. `--op-profile N` also runs torch.profiler over the first N steps of each kind, with the
kernel dispatch points labelled (`kvserve::<op>`, as bench/mixed_step_profile.py does), and
splits the forward by op class.

    OMP_NUM_THREADS=1 .venv/bin/python bench/c32_step_profile.py
    OMP_NUM_THREADS=1 .venv/bin/python bench/c32_step_profile.py --op-profile 2 --json out.json
    OMP_NUM_THREADS=1 .venv/bin/python bench/c32_step_profile.py --cpu-gemm onednn \
        --kv-pages default          # a quiet machine's GEMM plan; the cache as before issue 51

Prints a table per step kind (pure decode, decode + prefill chunk): median ms per step, share.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from kvserve.kernels.decode_stack import DecodeStack
from kvserve.llm import LLM
from kvserve.services.worker import model_runner, step_sampler
from kvserve.services.worker.layers.attention import KVCacheSpec
from kvserve.shared.sampling_params import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.mixed_step_profile import label_kernel_ops  # noqa: E402

VOCAB_LOW, VOCAB_HIGH = 100, 40000  # plain (non-special) token ids of SmolLM2
# phase -> its parent (the step is the root); a parent's own time is what its children leave
PARENTS = {
    "schedule": "step",
    "execute": "step",
    "update": "step",
    "runner_states": "execute",
    "prepare_inputs": "execute",
    "forward": "execute",
    "sample": "execute",
    "lm_head": "sample",
    "sampling_metadata": "sample",
    "sampler": "sample",
}
OP_CLASSES = {
    "gemm": ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise", "linear"),
    "attention": ("paged_attention", "flash", "sdpa", "attention"),
    "kv_write": ("write_kv_cache",),
    "norm_rope_act": ("rms_norm", "rotary", "silu_and_mul"),
    "decode_stack": ("decode_stack",),
}


class Clock:
    """Inclusive (thread CPU, wall) seconds per phase of the current step."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = defaultdict(float)
        self.wall: dict[str, float] = defaultdict(float)

    def wrap(self, owner: Any, attr: str, phase: str) -> None:
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            cpu, wall = time.thread_time(), time.perf_counter()
            try:
                with record_function(f"phase::{phase}"):
                    return fn(*args, **kwargs)
            finally:
                self.cpu[phase] += time.thread_time() - cpu
                self.wall[phase] += time.perf_counter() - wall

        setattr(owner, attr, timed)

    def take(self) -> tuple[dict[str, float], dict[str, float]]:
        """This step's phases, each less its children (its own time); then reset."""
        out = []
        for inclusive in (self.cpu, self.wall):
            own = dict(inclusive)
            for child, parent in PARENTS.items():
                if child in inclusive and parent in own:
                    own[parent] -= inclusive[child]
            out.append(own)
        self.cpu, self.wall = defaultdict(float), defaultdict(float)
        return out[0], out[1]


def _label_kernel_ops() -> None:
    """mixed_step_profile's kvserve::<op> ranges, and one around the native decode stack."""
    label_kernel_ops()
    run = DecodeStack.run

    def stack_run(self, *args, **kwargs):
        with record_function("kvserve::decode_stack"):
            return run(self, *args, **kwargs)

    DecodeStack.run = stack_run  # type: ignore[method-assign]


def _instrument(llm: LLM, clock: Clock) -> None:
    core = llm.engine_core
    runner = core.executor.worker.runner
    clock.wrap(core, "step", "step")
    clock.wrap(core.scheduler, "schedule", "schedule")
    clock.wrap(core.executor, "execute_model", "execute")
    clock.wrap(core.scheduler, "update_from_output", "update")
    clock.wrap(runner, "_update_states", "runner_states")
    clock.wrap(model_runner, "prepare_inputs", "prepare_inputs")
    clock.wrap(runner, "_forward", "forward")
    clock.wrap(runner.step_sampler, "sample", "sample")
    clock.wrap(runner.model, "compute_logits", "lm_head")
    clock.wrap(step_sampler, "build_sampling_metadata", "sampling_metadata")
    clock.wrap(runner.step_sampler, "sampler", "sampler")


def _op_class(name: str) -> str | None:
    low = name.lower()
    if name.startswith("phase::"):
        return None
    for cls, words in OP_CLASSES.items():
        if any(word in low for word in words):
            return cls
    return "other_ops"


def _forward_ops(prof) -> dict[str, float]:
    """Self CPU ms by op class of the ops under the forward (the profiler's tree)."""
    out: dict[str, float] = defaultdict(float)

    def walk(event, inside: bool) -> None:
        inside = inside or event.name == "phase::forward"
        if event.name == "phase::lm_head":
            return
        if inside and event.name != "phase::forward":
            cls = _op_class(event.name)
            if cls is not None:
                out[cls] += event.self_cpu_time_total / 1e3
        for child in event.cpu_children:
            walk(child, inside)

    for event in prof.events():
        if event.cpu_parent is None:
            walk(event, False)
    return dict(out)


def _small_pages() -> None:
    """The KV cache on the OS's default pages (torch.zeros), as before issue 51: the A side of
    an A/B of the huge-page cache (kernels/host_memory.py)."""

    def allocate(self, num_blocks, block_size, dtype, device):
        shape = (self.num_planes, num_blocks, block_size, self.num_kv_heads, self.head_size)
        return torch.zeros(shape, dtype=dtype, device=device)

    KVCacheSpec.allocate = allocate  # type: ignore[method-assign]


def run(args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(args.threads)
    if args.op_profile:
        _label_kernel_ops()
    if args.kv_pages == "default":
        _small_pages()
    llm = LLM(
        cpu_gemm=args.cpu_gemm,
        dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=2 << 30,
        max_model_len=2048,
    )
    clock = Clock()
    _instrument(llm, clock)
    core = llm.engine_core
    last_output: list[Any] = [None]
    schedule = core.scheduler.schedule

    def keep_output():
        last_output[0] = schedule()
        return last_output[0]

    core.scheduler.schedule = keep_output
    rng = np.random.default_rng(args.seed)
    params = SamplingParams(
        max_tokens=args.output_len, ignore_eos=True, temperature=args.temperature, seed=args.seed
    )
    num_sent = 0

    def send(count: int) -> None:
        nonlocal num_sent
        for _ in range(min(count, args.num_prompts - num_sent)):
            ids = rng.integers(VOCAB_LOW, VOCAB_HIGH, args.input_len).tolist()
            llm._add_request(f"req-{num_sent}", None, ids, params, 0)
            num_sent += 1

    send(args.concurrency)
    steps: list[dict] = []
    profiled: dict[str, int] = defaultdict(int)
    while core.scheduler.get_num_unfinished_requests():
        running = list(core.scheduler.running)
        num_decodes = sum(r.num_computed_tokens >= r.num_prompt_tokens for r in running)
        num_prefilling = len(running) - num_decodes + len(core.scheduler.waiting)
        kind = "decode" if num_prefilling == 0 else "mixed"
        prof = None
        if profiled[kind] < args.op_profile and len(steps) >= 2:
            prof = profile(activities=[ProfilerActivity.CPU])
            prof.__enter__()
        outputs = core.step()
        if prof is not None:
            prof.__exit__(None, None, None)
            profiled[kind] += 1
        cpu, wall = clock.take()
        num_tokens = last_output[0].total_num_scheduled_tokens
        record = {
            "kind": kind,
            "decodes": num_decodes,
            "tokens": num_tokens,
            "cpu_ms": {k: round(1e3 * v, 3) for k, v in cpu.items()},
            "wall_ms": {k: round(1e3 * v, 3) for k, v in wall.items()},
        }
        if prof is not None:
            record["forward_ops_ms"] = {k: round(v, 3) for k, v in _forward_ops(prof).items()}
        steps.append(record)
        send(sum(1 for o in outputs.outputs if o.finish_reason is not None))
    return steps


def _table(steps: list[dict], kind: str, clock: str) -> None:
    chosen = [s for s in steps[2:] if s["kind"] == kind]  # the first two steps warm up
    if not chosen:
        return
    phases = sorted({p for s in chosen for p in s[clock]})
    medians = {p: statistics.median(s[clock].get(p, 0.0) for s in chosen) for p in phases}
    total = statistics.median(sum(s[clock].values()) for s in chosen)
    decodes = statistics.median(s["decodes"] for s in chosen)
    print(f"\n{kind} steps ({len(chosen)}, median {decodes:.0f} decode rows), {clock}:")
    print(f"  {'phase':<20} {'ms/step':>9} {'share':>7}")
    for p in sorted(phases, key=lambda p: -medians[p]):
        print(f"  {p:<20} {medians[p]:9.2f} {100 * medians[p] / total:6.1f}%")
    print(f"  {'step (median of sums)':<20} {total:9.2f}")
    ops = [s["forward_ops_ms"] for s in chosen if "forward_ops_ms" in s]
    if ops and clock == "cpu_ms":
        classes = sorted({c for o in ops for c in o})
        print(f"  forward by op class (torch.profiler self CPU, median of {len(ops)} steps):")
        for c in classes:
            print(f"    {c:<18} {statistics.median(o.get(c, 0.0) for o in ops):9.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--op-profile", type=int, default=0, help="profile N steps per kind")
    parser.add_argument("--json", help="write every step's record here")
    parser.add_argument(
        "--cpu-gemm", default="auto", help="--cpu-gemm (onednn: a quiet machine's plan)"
    )
    parser.add_argument(
        "--kv-pages",
        choices=("huge", "default"),
        default="huge",
        help="default: the KV cache on the OS's default pages (before issue 51)",
    )
    args = parser.parse_args()
    start = time.perf_counter()
    steps = run(args)
    elapsed = time.perf_counter() - start
    for kind in ("decode", "mixed"):
        for clock in ("cpu_ms", "wall_ms"):
            _table(steps, kind, clock)
    total_cpu = sum(sum(s["cpu_ms"].values()) for s in steps) / 1e3
    by_kind = {
        k: round(sum(sum(s["cpu_ms"].values()) for s in steps if s["kind"] == k) / 1e3, 2)
        for k in ("decode", "mixed")
    }
    print(
        f"\n{len(steps)} steps, thread CPU {total_cpu:.1f} s of steps {by_kind}, "
        f"run wall {elapsed:.1f} s (with start-up); "
        f"{args.num_prompts * args.output_len / total_cpu:.1f} output tok per CPU second"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "steps": steps}, f)


if __name__ == "__main__":
    main()
