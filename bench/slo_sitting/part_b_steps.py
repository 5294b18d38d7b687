"""Part (b) of issue 46's sitting through the shipped engine in-process, step by step: where
the chat streams' gaps beside an 8,000-token document come from.

    nice -n 10 .venv/bin/python bench/slo_sitting/part_b_steps.py --threads 1 --out /tmp/b1.jsonl

The real EngineCore (model, Scheduler with its latency targets, worker), as `kvserve.LLM`
builds it: CHATS requests of CHAT_IN random tokens / CHAT_OUT out with a TPOT target
(--tpot-ms, as the sitting's x-slo-tpot-ms header), run alone, then again with one DOC_LEN
token document (no target, 1 token out) added --doc-delay-s seconds after the chats start.
The engine loop is this script's (EngineCore.step, then the output processor detokenizes, as
the server's api does): every step is timed in wall, thread CPU and process CPU time, with
its shape (decode rows, prompt tokens and chunks, keys attended by the step), the step-time
model's mean prediction and the plan's (ratio quantile and unseen time included), and its
phases (schedule, forward, update, detokenize; the cyclic GC's pauses inside the step). Each
chat's inter-token gaps are the gaps between the ends of the steps that gave it a token
(the engine's gaps; the api's streaming adds its own). Prints a summary of each run: the chats'
ITL P50/P99 and worst gap, the steps behind the worst gaps, and the prediction error by step
kind. --out writes one JSON line per step.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import time
from typing import Any

import msgspec
import numpy as np
import torch

from kvserve.llm import LLM
from kvserve.services.api.serving.latency_targets import LatencyTargets
from kvserve.services.api.serving.output_processor import make_engine_requests
from kvserve.services.scheduler.core.step_time import shape_of
from kvserve.shared.sampling_params import SamplingParams

VOCAB_LOW, VOCAB_HIGH = 100, 40000  # plain (non-special) token ids of SmolLM2


class GcPauses:
    """The cyclic collector's pauses (gc.callbacks), summed until taken."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.total_s += time.perf_counter() - self._start

    def take(self) -> float:
        total, self.total_s = self.total_s, 0.0
        return total


class Phases:
    """Wall seconds of the step's schedule and forward (wrapped engine methods)."""

    def __init__(self, core: Any) -> None:
        self.seconds = {"schedule": 0.0, "forward": 0.0}
        self._wrap(core.scheduler, "schedule", "schedule")
        self._wrap(core.executor, "execute_model", "forward")

    def _wrap(self, owner: Any, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        taken = dict(self.seconds)
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        return taken


def _add(
    llm: LLM,
    req_id: str,
    num_tokens: int,
    max_tokens: int,
    tpot_ms: float | None,
    rng: np.random.Generator,
) -> None:
    """One request (random plain tokens, greedy, ignore_eos; `tpot_ms` its TPOT target),
    arriving now on the scheduler's clock."""
    ids = rng.integers(VOCAB_LOW, VOCAB_HIGH, num_tokens).tolist()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    child_ids = llm.output_processor.add_request(req_id, None, ids, params)
    targets = LatencyTargets(tpot_ms=tpot_ms) if tpot_ms else None
    for request in make_engine_requests(
        child_ids, ids, params, 0, llm.tokenizer_info, targets=targets
    ):
        now = llm.engine_core.scheduler.latency.clock()
        llm.engine_core.add_request(msgspec.structs.replace(request, arrival_time=now))


def _planned(core: Any, shape: Any) -> tuple[float, float]:
    """The model's mean prediction of `shape` and the plan's (quantile and unseen time)."""
    latency = core.scheduler.latency
    mean = latency.model.predict(shape)
    return mean, latency.unseen.quantile_s + latency.model.ratio_quantile * mean


def run(
    llm: LLM,
    args: argparse.Namespace,
    with_doc: bool,
    seed: int,
    phases: Phases,
    pauses: GcPauses,
    tpot_ms: float | None,
) -> list[dict]:
    """One run: the chats (TPOT target `tpot_ms`; None: fcfs) and the document; one
    record per step."""
    core = llm.engine_core
    rng = np.random.default_rng(seed)
    phases.take(), pauses.take()
    chats = [f"chat-{seed}-{i}" for i in range(args.chats)]
    for req_id in chats:
        _add(llm, req_id, args.chat_in, args.chat_out, tpot_ms, rng)
    clock = time.thread_time if args.cpu_clock else time.perf_counter
    start, doc_added, steps = clock(), not with_doc, []
    cpu_clock = 0.0  # thread CPU seconds of the loop's steps (and detokenizing) so far
    while core.has_work() or not doc_added:
        if not doc_added and clock() - start >= args.doc_delay_s:
            _add(llm, f"doc-{seed}", args.doc_len, 1, None, rng)
            doc_added = True
        if not core.has_work():
            time.sleep(0.001)
            continue
        wall0, thread0, process0 = time.perf_counter(), time.thread_time(), time.process_time()
        out = core.step()
        wall1, thread1, process1 = time.perf_counter(), time.thread_time(), time.process_time()
        request_outputs, _ = llm.output_processor.process_outputs(out.outputs)
        detok_s = time.perf_counter() - wall1
        cpu_clock += time.thread_time() - thread0
        scheduled = core.scheduler.last_output if hasattr(core.scheduler, "last_output") else None
        record = _step_record(core, scheduled)
        record.update(
            t=wall1 - start,
            t_cpu=cpu_clock,
            wall=wall1 - wall0,
            thread_cpu=thread1 - thread0,
            process_cpu=process1 - process0,
            detok=detok_s,
            gc=pauses.take(),
            tokens={o.request_id: len(o.new_token_ids) for o in out.outputs if o.new_token_ids},
            **phases.take(),
        )
        steps.append(record)
        del request_outputs
    return steps


def _step_record(core: Any, scheduled: Any) -> dict:
    """The step's shape and its predictions (read off the step the scheduler planned)."""
    if scheduled is None:
        return {}
    shape = shape_of(scheduled)
    mean, planned = core.scheduler.last_prediction
    return {
        "decode_rows": shape.num_decode_rows,
        "prefill_tokens": shape.num_prefill_tokens,
        "prefill_chunks": shape.num_prefill_chunks,
        "context": shape.num_context_tokens,
        "predicted_mean": mean,
        "predicted_plan": planned,
        "ratio_q": core.scheduler.latency.model.ratio_quantile,
        "unseen_q": core.scheduler.latency.unseen.quantile_s,
        "budget": core.scheduler.last_budget.token_budget,
        "prefill_budget": core.scheduler.last_budget.prefill_budget,
        "waiting": len(core.scheduler.waiting),
    }


def cpu_clock(core: Any) -> None:
    """Run the latency targets on this thread's CPU time (one torch thread: the whole
    step's compute), as a quiet machine would: the step-time model learns each step's
    thread CPU time, and the TPOT paces, TTFT deadlines and unseen time follow the same
    clock (requests arrive on it: _add). Outside load then stretches the wall clock only."""
    scheduler = core.scheduler
    origin = time.time() - time.thread_time()
    scheduler.latency.clock = lambda: origin + time.thread_time()
    record = scheduler.record_step_time
    schedule = scheduler.schedule
    started = [0.0]

    def schedule_and_start() -> Any:
        started[0] = time.thread_time()
        return schedule()

    def record_cpu(scheduler_output: Any, seconds: float) -> None:
        record(scheduler_output, time.thread_time() - started[0])

    scheduler.schedule = schedule_and_start
    scheduler.record_step_time = record_cpu


def _capture(core: Any) -> None:
    """Keep the scheduler's latest SchedulerOutput and its predictions (before the step's
    measurement refits the model)."""
    scheduler = core.scheduler
    schedule = scheduler.schedule

    def schedule_and_keep() -> Any:
        output = schedule()
        scheduler.last_output = output
        scheduler.last_prediction = _planned(core, shape_of(output))
        return output

    scheduler.schedule = schedule_and_keep
    step_budget = scheduler.latency.step_budget

    def budget_and_keep(running: Any, waiting: Any) -> Any:
        scheduler.last_budget = step_budget(running, waiting)
        return scheduler.last_budget

    scheduler.latency.step_budget = budget_and_keep


def itl(
    steps: list[dict], req_prefix: str, clock: str = "t"
) -> tuple[list[float], list[tuple[float, int]]]:
    """The chats' gaps between tokens (engine side) on `clock` (t: wall; t_cpu: the loop's
    thread CPU time, steady under outside load with one torch thread) and, per gap, the
    index of the step that ended it."""
    last: dict[str, float] = {}
    gaps: list[tuple[float, int]] = []
    for index, step in enumerate(steps):
        for req_id, count in step.get("tokens", {}).items():
            if not req_id.startswith(req_prefix) or not count:
                continue
            end = step[clock]
            if req_id in last:
                gaps.append((end - last[req_id], index))
            last[req_id] = end
    return sorted(g for g, _ in gaps), gaps


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(int(q * len(values)), len(values) - 1)]


def summarize(label: str, steps: list[dict], args: argparse.Namespace) -> dict:
    """The chats' ITL (wall and CPU clocks), step kinds' times against the plan, and the
    steps inside the worst gaps (CPU clock with one thread, wall otherwise)."""
    sorted_gaps, gaps = itl(steps, "chat-")
    summary = {
        "run": label,
        "steps": len(steps),
        "itl_p50_ms": 1e3 * _pct(sorted_gaps, 0.5),
        "itl_p99_ms": 1e3 * _pct(sorted_gaps, 0.99),
        "itl_max_ms": 1e3 * (sorted_gaps[-1] if sorted_gaps else float("nan")),
    }
    cpu_gaps, _ = itl(steps, "chat-", "t_cpu")
    summary.update(
        itl_cpu_p50_ms=1e3 * _pct(cpu_gaps, 0.5),
        itl_cpu_p99_ms=1e3 * _pct(cpu_gaps, 0.99),
        itl_cpu_max_ms=1e3 * (cpu_gaps[-1] if cpu_gaps else float("nan")),
    )
    kinds: dict[str, list[dict]] = {"decode-only": [], "with chunk": [], "prompt only": []}
    for step in steps:
        if "predicted_mean" not in step or not step["thread_cpu"]:
            continue
        if not step["decode_rows"]:
            kinds["prompt only"].append(step)
        else:
            kinds["with chunk" if step["prefill_tokens"] else "decode-only"].append(step)
    for kind, chosen in kinds.items():
        if chosen:
            summary[kind] = {
                "n": len(chosen),
                "wall_ms_p50": 1e3 * statistics.median(s["wall"] for s in chosen),
                "wall_ms_max": 1e3 * max(s["wall"] for s in chosen),
                "wall/plan_p50": statistics.median(s["wall"] / s["predicted_plan"] for s in chosen),
                "wall/plan_max": max(s["wall"] / s["predicted_plan"] for s in chosen),
                "cpu_ms_p50": 1e3 * statistics.median(s["thread_cpu"] for s in chosen),
                "cpu/mean_p50": statistics.median(
                    s["thread_cpu"] / s["predicted_mean"] for s in chosen
                ),
                "cpu/mean_p90": _pct(
                    sorted(s["thread_cpu"] / s["predicted_mean"] for s in chosen), 0.9
                ),
                "thread_cpu/wall_p50": statistics.median(
                    s["thread_cpu"] / s["wall"] for s in chosen
                ),
            }
    _, cpu_indexed = itl(steps, "chat-", "t_cpu")
    worst = sorted(cpu_indexed if args.threads == 1 else gaps, reverse=True)[: args.worst]
    summary["worst"] = [_gap_steps(steps, gap, index) for gap, index in worst]
    return summary


def _gap_steps(steps: list[dict], gap: float, index: int) -> dict:
    """The steps inside a gap: those that ended after the gap's start, up to its end."""
    clock = "t_cpu" if "t_cpu" in steps[index] else "t"
    start = steps[index][clock] - gap
    inside = [s for s in steps[: index + 1] if s[clock] > start + 1e-9]
    keys = (
        "wall",
        "thread_cpu",
        "predicted_plan",
        "predicted_mean",
        "schedule",
        "forward",
        "detok",
        "gc",
        "decode_rows",
        "prefill_tokens",
        "context",
    )
    return {
        "gap_ms": round(1e3 * gap, 1),
        "steps": [
            {k: (round(1e3 * s[k], 1) if isinstance(s.get(k), float) else s.get(k)) for k in keys}
            for s in inside
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="/tmp/smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chats", type=int, default=4)
    parser.add_argument("--chat-in", type=int, default=128)
    parser.add_argument("--chat-out", type=int, default=128)
    parser.add_argument("--tpot-ms", type=float, default=127.0)
    parser.add_argument("--doc-len", type=int, default=8000)
    parser.add_argument("--doc-delay-s", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--modes",
        default="fcfs,targets",
        help="in this order on one engine, as the sitting's server runs them "
        "(fcfs: the chats carry no target; the model learns from every step)",
    )
    parser.add_argument("--worst", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--wall-clock",
        dest="cpu_clock",
        action="store_false",
        help="the engine on the wall clock (default with --threads 1: CPU time)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.cpu_clock = args.cpu_clock and args.threads == 1
    llm = LLM(
        args.model, dtype="float32", max_model_len=8192, kv_cache_memory=512 << 20, max_num_seqs=16
    )
    if args.cpu_clock:
        cpu_clock(llm.engine_core)
    _capture(llm.engine_core)
    phases, pauses = Phases(llm.engine_core), GcPauses()
    out = open(args.out, "w") if args.out else None
    model = llm.engine_core.scheduler.latency.model
    print(json.dumps({"prompt_keys_per_token": getattr(model, "prompt_keys_per_token", 0)}))
    for round_index in range(args.rounds):
        for mode, with_doc in itertools.product(args.modes.split(","), (False, True)):
            label = f"r{round_index} {mode} {'with document' if with_doc else 'alone'}"
            tpot_ms = args.tpot_ms if mode == "targets" else None
            seed = 2 * round_index + int(with_doc)  # each mode the same prompts
            steps = run(llm, args, with_doc, seed, phases, pauses, tpot_ms)
            llm.reset_prefix_cache()
            print(json.dumps(summarize(label, steps, args)), flush=True)
            if out is not None:
                for step in steps:
                    out.write(json.dumps({"run": label, **step}) + "\n")
    if out is not None:
        out.close()


if __name__ == "__main__":
    main()
