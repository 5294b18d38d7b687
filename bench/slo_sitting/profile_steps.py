"""Why the documents (no target) fall behind in bench/slo_sitting/simulate.py's workload: the
steps taken while a document has prompt tokens left, what bound each one, and how many
carried none of the document's tokens, and why.

    python bench/slo_sitting/profile_steps.py --rates 0.5 0.3 --seeds 11 12 13 14 15

Per run (targets on): the share of the run a document was pending; of those steps, the share
with no document token and its cause (targeted prompts took the prompt share, the document
waited for admission, no prompt room at all); the document's median chunk beside 0, 1-2 and
3+ decodes; which limit was the tightest (TPOT per step, TTFT deadline, the arrival cap) and
how often the pace floor raised the step; the document tokens per second of pending time
against their arrival rate; and what the pending time was spent on (per-step fixed cost:
the step's intercept and the unseen time after it; decode rows; attention; the prompt-chunk
jump, --chunk-ms; the documents' and the chats' prompt tokens), per run and over all seeds.
The rule's internals are read by wrapping LatencyTargets'
methods on the scheduler the simulation drives (bench only).
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from simulate import TRUTH, Machine, figures, simulate

from kvserve.services.scheduler.core.request import RequestStatus
from kvserve.services.scheduler.core.scheduler import Scheduler
from kvserve.services.scheduler.core.step_time import shape_of
from kvserve.shared.messages import SchedulerOutput


@dataclass
class Profile:
    """What the steps of one run did for the documents."""

    num_steps: int = 0
    run_s: float = 0.0
    pending_s: float = 0.0
    num_pending: int = 0
    doc_tokens: int = 0
    zero: Counter[str] = field(default_factory=Counter)
    binding: Counter[str] = field(default_factory=Counter)
    num_floor: int = 0
    chunks: dict[str, list[int]] = field(default_factory=lambda: {"0": [], "1-2": [], "3+": []})
    step_s: list[float] = field(default_factory=list)
    # (document tokens, seconds of steps) beside decodes and without any
    beside: list[float] = field(default_factory=lambda: [0.0, 0.0])
    alone: list[float] = field(default_factory=lambda: [0.0, 0.0])
    record: dict[str, Any] = field(default_factory=dict)
    wrapped: bool = False
    machine: Machine = field(default_factory=Machine)
    # Seconds of pending time by what they computed (the truth's terms, scaled by the step's
    # noise; the unseen time between steps counts as per-step fixed cost).
    spent: Counter[str] = field(default_factory=Counter)


def _spend(profile: Profile, out: SchedulerOutput, seconds: float, num_doc: int) -> None:
    """Split a pending step's seconds (and the mean unseen time after it) by the truth's
    terms: per-step fixed, decode rows, attention, the prompt-chunk jump, prompt tokens."""
    shape = shape_of(out)
    c0, c1, c2, c3, _ = TRUTH
    terms = {
        "per-step fixed": c0,
        "decode rows": c2 * shape.num_decode_rows / 1e2,
        "attention": c3 * shape.num_context_tokens / 1e6,
        "prompt-chunk jump": profile.machine.chunk_s * shape.num_prefill_chunks,
        "document prompt": c1 * num_doc / 1e3,
        "chats' prompts": c1 * (shape.num_prefill_tokens - num_doc) / 1e3,
    }
    scale = seconds / sum(terms.values())
    for name, value in terms.items():
        profile.spent[name] += value * scale
    profile.spent["per-step fixed"] += sum(profile.machine.overhead_s) / 2


def _wrap(scheduler: Scheduler, record: dict[str, Any]) -> None:
    """Record the rule's limits each step (the methods of latency_targets.LatencyTargets)."""
    latency = scheduler.latency

    def wrap(name: str, key: str, pick=lambda value: value, first: bool = False) -> None:
        original = getattr(latency, name)

        def wrapper(*args: Any) -> Any:
            value = original(*args)
            if not first or key not in record:
                record[key] = pick(value)
            return value

        setattr(latency, name, wrapper)

    wrap("_running_decodes", "tpot", lambda d: d.tightest_tpot_s)
    wrap("_ttft_limit", "ttft")
    wrap("_arrival_limit", "arrival")
    wrap("_max_prefill_tokens", "max_prefill", first=True)
    wrap("_urgent_floor", "floor")
    original_budget = latency.step_budget

    def step_budget(*args: Any) -> Any:
        record.clear()
        budget = original_budget(*args)
        record["budget"] = budget
        return budget

    latency.step_budget = step_budget  # type: ignore[method-assign]


def _on_step(profile: Profile, scheduler: Scheduler, out: SchedulerOutput, seconds: float) -> None:
    if not profile.wrapped:
        _wrap(scheduler, profile.record)
        profile.wrapped = True
        return
    profile.num_steps += 1
    profile.run_s += seconds
    chunks = {
        req_id: n
        for req_id, n in out.num_scheduled_tokens.items()
        if req_id.startswith("long") and n > 1
    }
    pending = [
        r
        for r in scheduler.requests.values()
        if r.req_id.startswith("long") and r.num_computed_tokens < r.num_prompt_tokens
    ]
    if not chunks and not pending:
        return
    profile.num_pending += 1
    profile.pending_s += seconds
    profile.step_s.append(seconds)
    num_doc = sum(chunks.values())
    profile.doc_tokens += num_doc
    _spend(profile, out, seconds, num_doc)
    record = profile.record
    budget = record.get("budget")
    num_rows = shape_of(out).num_decode_rows
    rate = profile.beside if num_rows else profile.alone
    rate[0] += num_doc
    rate[1] += seconds
    if num_doc:
        bucket = "0" if num_rows == 0 else "1-2" if num_rows <= 2 else "3+"
        profile.chunks[bucket].append(num_doc)
    elif all(r.status != RequestStatus.RUNNING for r in pending):
        profile.zero["waiting (not admitted)"] += 1
    elif budget is not None and budget.running_prefill_budget == 0:
        profile.zero["targeted prompts took the prompt share"] += 1
    elif budget is not None and budget.prefill_budget == 0:
        profile.zero["no prompt room"] += 1
    else:
        profile.zero["other"] += 1
    if "tpot" not in record:
        profile.binding["no target live"] += 1
        return
    limits = {"tpot per step": record["tpot"], "ttft deadline": record["ttft"]}
    limits["arrival cap"] = record["arrival"]
    name, value = min(limits.items(), key=lambda item: item[1])
    profile.binding[name if value != float("inf") else "none"] += 1
    if record.get("floor", 0) > record.get("max_prefill", 0):
        profile.num_floor += 1


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def _report(rate: float, seed: int, profile: Profile, line: str) -> None:
    n = profile.num_pending
    print(f"rate {rate} seed {seed}: {line}")
    print(
        f"  doc pending {profile.pending_s:.0f} of {profile.run_s:.0f} s of steps "
        f"({n} steps, median {1000 * statistics.median(profile.step_s or [0]):.0f} ms); "
        f"doc tokens / s pending {profile.doc_tokens / max(profile.pending_s, 1e-9):.0f}"
    )
    zeros = ", ".join(f"{k} {_pct(v, n)}" for k, v in profile.zero.most_common())
    print(f"  steps with no doc token: {_pct(sum(profile.zero.values()), n)} ({zeros})")
    chunks = ", ".join(
        f"{k} decodes: {statistics.median(v) if v else '-'} ({len(v)})"
        for k, v in profile.chunks.items()
    )
    print(f"  median doc chunk beside {chunks}")
    beside, alone = profile.beside, profile.alone
    print(
        f"  doc tokens / s of step: beside decodes {beside[0] / max(beside[1], 1e-9):.0f} "
        f"({beside[1]:.0f} s), without {alone[0] / max(alone[1], 1e-9):.0f} ({alone[1]:.0f} s)"
    )
    total = sum(profile.spent.values())
    spent = ", ".join(f"{k} {_pct(v, total)}" for k, v in profile.spent.most_common())
    print(f"  pending time ({total:.0f} s with the unseen time) spent on: {spent}")
    binding = ", ".join(f"{k} {_pct(v, n)}" for k, v in profile.binding.most_common())
    print(f"  tightest limit: {binding}; pace floor raised {_pct(profile.num_floor, n)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 0.3])
    parser.add_argument("--seeds", type=int, nargs="+", default=[11, 12, 13, 14, 15])
    parser.add_argument("--noise", type=float, default=0.30)
    parser.add_argument("--overhead-ms", type=float, nargs=2, default=[15.0, 25.0])
    parser.add_argument("--chunk-ms", type=float, default=0.0)
    parser.add_argument("--duration", type=float, default=120.0)
    args = parser.parse_args()
    machine = Machine(
        args.noise, (args.overhead_ms[0] / 1000, args.overhead_ms[1] / 1000), args.chunk_ms / 1000
    )
    for rate in args.rates:
        spent: Counter[str] = Counter()
        num_steps = 0
        for seed in args.seeds:
            profile = Profile(machine=machine)
            tokens = simulate(
                rate,
                seed,
                True,
                machine,
                args.duration,
                lambda s, o, t, p=profile: _on_step(p, s, o, t),
            )
            f = figures(tokens)
            line = (
                f"goodput {f.goodput:.3f} ({f.num_met}/{f.num_short}), run {f.run_s:.0f} s, "
                f"long P50 TTFT {f.long_ttft_p50:.1f} s"
            )
            _report(rate, seed, profile, line)
            spent.update(profile.spent)
            num_steps += profile.num_pending
        total = sum(spent.values())
        shares = ", ".join(f"{k} {_pct(v, total)}" for k, v in spent.most_common())
        print(
            f"rate {rate}, all seeds: {total:.0f} s pending in {num_steps} steps "
            f"({1000 * total / max(num_steps, 1):.0f} ms a step with the unseen time): {shares}"
        )


if __name__ == "__main__":
    main()
