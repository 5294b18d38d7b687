"""Measure kvserve engine step times on a few batch shapes and fit a linear step-time model.

The DP routing simulator (`bench/dp_routing_sim/`) needs to know how long one engine step
takes for a given batch. This script runs the real default model in-process through
`kvserve.LLM`, steps its engine core by hand (`schedule -> execute_model ->
update_from_output`, the body of `EngineCore.step`), times each step and records the step's
shape. Then it fits, by least squares,

    step_s = a + b * num_prefill_tokens + c * num_decode_reqs + d * num_decode_ctx_tokens

where num_decode_ctx_tokens is the sum of the decoding requests' context lengths (what decode
attention reads). Coefficients and raw samples go to `bench/step_times.json`.

    .venv/bin/python bench/measure_step_times.py --dtype bfloat16 --out bench/step_times.json

Shapes: prefill-only steps of 64 / 256 / 1024 / 2048 tokens; decode-only steps with 1 / 8 / 32
/ 64 running requests at short and long contexts; mixed steps (decodes plus a prompt chunk).
Prefix caching is off so every prompt token is computed. The first step of each scenario is
dropped (allocator and kernel warm-up), and the fit uses each scenario's median step. The
scenarios run cheapest first until `--max-seconds` (default 150 s), and the JSON is rewritten
after each one, so a slow or killed run still leaves what it measured.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import time
from collections.abc import Callable

import numpy as np

from kvserve.shared.logging import init_logger
from kvserve.shared.messages import EngineCoreRequest
from kvserve.shared.sampling_params import SamplingParams

logger = init_logger(__name__)

FEATURES = ("num_prefill_tokens", "num_decode_reqs", "num_decode_ctx_tokens")
VOCAB_LOW, VOCAB_HIGH = 100, 40000  # plain (non-special) token ids of SmolLM2


class StepTimer:
    """Steps an in-process engine core by hand and records (shape, seconds) per step.

    Args:
        engine_core: the `EngineCore` of a `kvserve.LLM`.
        seed: seed of the random prompt token ids.
    """

    def __init__(self, engine_core, seed: int = 0):
        self.engine_core = engine_core
        self.rng = np.random.default_rng(seed)
        self.samples: list[dict] = []
        self._next_id = 0

    def add_requests(self, num_reqs: int, prompt_len: int, max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        for _ in range(num_reqs):
            ids = self.rng.integers(VOCAB_LOW, VOCAB_HIGH, size=prompt_len).tolist()
            self.engine_core.add_request(
                EngineCoreRequest(f"m{self._next_id}", ids, params, None, time.time())
            )
            self._next_id += 1

    def step(self, scenario: str, record: bool = True) -> dict:
        """One timed engine step; returns its sample (also kept when `record`)."""
        scheduler = self.engine_core.scheduler
        start = time.perf_counter()
        scheduler_output = scheduler.schedule()
        shape_start = time.perf_counter()
        sample = self._shape(scheduler_output)
        shape_s = time.perf_counter() - shape_start
        runner_output = self.engine_core.executor.execute_model(scheduler_output)
        scheduler.update_from_output(scheduler_output, runner_output)
        sample["seconds"] = time.perf_counter() - start - shape_s
        sample["scenario"] = scenario
        if record and (sample["num_prefill_tokens"] or sample["num_decode_reqs"]):
            self.samples.append(sample)
        return sample

    def _shape(self, scheduler_output) -> dict:
        """The step's features, read right after schedule() (which has already advanced
        each scheduled request's num_computed_tokens)."""
        shape = {
            "num_prefill_tokens": 0,
            "num_prefill_reqs": 0,
            "num_decode_reqs": 0,
            "num_decode_ctx_tokens": 0,
        }
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.engine_core.scheduler.requests[req_id]
            if request.num_computed_tokens - num_tokens < request.num_prompt_tokens:
                shape["num_prefill_tokens"] += num_tokens
                shape["num_prefill_reqs"] += 1
            else:
                shape["num_decode_reqs"] += 1
                shape["num_decode_ctx_tokens"] += request.num_computed_tokens
        return shape

    def drain(self, scenario: str, max_steps: int, skip_first: int = 1) -> None:
        """Step until idle or `max_steps`, recording all but the first `skip_first` steps,
        then abort what is left."""
        for index in range(max_steps):
            if not self.engine_core.has_work():
                return
            self.step(scenario, record=index >= skip_first)
        self.abort_all()

    def finish_prefills(self) -> None:
        """Step (unrecorded) until every request has its prompt computed."""
        requests = self.engine_core.scheduler.requests
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in requests.values()):
            self.step("prefill_warmup", record=False)

    def abort_all(self) -> None:
        req_ids = list(self.engine_core.scheduler.requests)
        if req_ids:
            self.engine_core.abort_requests(req_ids)
        while self.engine_core.has_work():  # deliver the abort outputs
            self.engine_core.step()


def make_scenarios(quick: bool) -> list[tuple[str, Callable[[StepTimer], None]]]:
    """Prefill-only, decode-only and mixed steps, cheapest first; `quick` trims them for a
    smoke test."""
    scenarios = []
    for prompt_len in (64, 256) if quick else (64, 256, 1024, 2048):
        scenarios.append(
            (f"prefill_{prompt_len}", functools.partial(prefill_scenario, prompt_len=prompt_len))
        )
    decode_shapes = (
        ((1, 64), (8, 64))
        if quick
        else ((1, 128), (8, 128), (32, 128), (64, 128), (32, 512), (8, 1024))
    )
    for num_reqs, prompt_len in decode_shapes:
        scenarios.append(
            (
                f"decode_{num_reqs}x{prompt_len}",
                functools.partial(
                    decode_scenario,
                    num_reqs=num_reqs,
                    prompt_len=prompt_len,
                    num_steps=3 if quick else 5,
                ),
            )
        )
    for num_decodes, chunk_len in ((8, 256),) if quick else ((8, 256), (32, 1024)):
        scenarios.append(
            (
                f"mixed_{num_decodes}+{chunk_len}",
                functools.partial(mixed_scenario, num_decodes=num_decodes, chunk_len=chunk_len),
            )
        )
    return scenarios


def prefill_scenario(timer: StepTimer, prompt_len: int) -> None:
    # One prompt per step (max_tokens=1 ends it there); the first is warm-up.
    for index in range(3):
        timer.add_requests(1, prompt_len, max_tokens=1)
        timer.step(f"prefill_{prompt_len}", record=index > 0)
    timer.abort_all()


def decode_scenario(timer: StepTimer, num_reqs: int, prompt_len: int, num_steps: int) -> None:
    timer.add_requests(num_reqs, prompt_len, max_tokens=num_steps + 2)
    timer.finish_prefills()  # not recorded: prefill shapes have their own scenarios
    timer.drain(f"decode_{num_reqs}x{prompt_len}", max_steps=num_steps)


def mixed_scenario(timer: StepTimer, num_decodes: int, chunk_len: int) -> None:
    timer.add_requests(num_decodes, 128, max_tokens=64)
    timer.finish_prefills()
    timer.step("mixed_warmup", record=False)
    for _ in range(2):
        timer.add_requests(1, chunk_len, max_tokens=1)
        timer.step(f"mixed_{num_decodes}+{chunk_len}")
        timer.step("mixed_tail", record=False)  # the prompt's sampling step
    timer.abort_all()


def median_per_scenario(samples: list[dict]) -> list[dict]:
    """One point per scenario: mean features, median seconds (the VM's noise comes in
    spikes, which a median ignores)."""
    by_scenario: dict[str, list[dict]] = {}
    for sample in samples:
        by_scenario.setdefault(sample["scenario"], []).append(sample)
    points = []
    for scenario, group in by_scenario.items():
        point = {name: float(np.mean([s[name] for s in group])) for name in FEATURES}
        point["seconds"] = float(np.median([s["seconds"] for s in group]))
        point["scenario"] = scenario
        points.append(point)
    return points


def fit_step_model(samples: list[dict]) -> dict:
    """Least-squares fit of `seconds ~ 1 + FEATURES` over per-scenario medians, minimizing
    relative error (rows divided by the step time): a 0.2 s decode step matters as much as a
    3 s prefill, and most simulated steps are decodes. A feature whose coefficient comes out
    negative is dropped and the fit redone, so the model never predicts a cheaper step for
    more work."""
    samples = median_per_scenario(samples)
    seconds = np.array([s["seconds"] for s in samples])
    active = list(FEATURES)
    while True:
        x = np.column_stack(
            [np.ones(len(samples))] + [[s[name] for s in samples] for name in active]
        )
        coef, *_ = np.linalg.lstsq(x / seconds[:, None], np.ones(len(samples)), rcond=None)
        negative = [name for name, c in zip(active, coef[1:]) if c < 0]
        if not negative:
            break
        active.remove(negative[0])
    predicted = x @ coef
    coefficients = {"intercept_s": float(coef[0])}
    for name in FEATURES:
        coefficients[name] = float(coef[1 + active.index(name)]) if name in active else 0.0
    relative_error = np.abs(predicted - seconds) / seconds
    ss_res = float(np.sum((seconds - predicted) ** 2))
    ss_tot = float(np.sum((seconds - seconds.mean()) ** 2))
    return {
        "coefficients": coefficients,
        "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
        "median_relative_error": float(np.median(relative_error)),
        "max_relative_error": float(np.max(relative_error)),
        "fit_points": [{**s, "predicted_s": float(p)} for s, p in zip(samples, predicted)],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--out", default="bench/step_times.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick", action="store_true", help="a handful of small shapes (smoke test, ~15 s)"
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=150.0,
        help="skip the remaining scenarios after this long",
    )
    parser.add_argument(
        "--refit",
        action="store_true",
        help="refit the samples already in --out instead of measuring",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads; 1 by default: on the shared 2-core VM, two "
        "OpenMP threads spin on each other under load and gave 3-10x "
        "slower, erratic steps",
    )
    args = parser.parse_args(argv)

    if args.refit:
        with open(args.out) as f:
            saved = json.load(f)
        saved.update(fit_step_model(saved["samples"]))
        with open(args.out, "w") as f:
            json.dump(saved, f, indent=1)
        print(f"refitted {len(saved['samples'])} saved steps: {saved['coefficients']}")
        return

    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch is first imported
    import torch

    from kvserve import LLM

    torch.set_num_threads(args.threads)

    started = time.perf_counter()
    llm = LLM(
        model=None,
        dtype=args.dtype,
        enable_prefix_caching=False,
        max_num_batched_tokens=2048,
        max_num_seqs=256,
        seed=args.seed,
    )
    timer = StepTimer(llm.engine_core, args.seed)
    skipped = []
    for name, scenario in make_scenarios(args.quick):
        if time.perf_counter() - started > args.max_seconds:
            skipped.append(name)  # over the time budget: keep what we have
            continue
        scenario(timer)
        logger.info("scenario %s done at %.0f s", name, time.perf_counter() - started)
        # Written after every scenario, so a killed run still leaves its samples.
        write_result(args, timer.samples, skipped, time.perf_counter() - started)
    result = write_result(args, timer.samples, skipped, time.perf_counter() - started)
    coef = result["coefficients"]
    print(
        f"{len(timer.samples)} steps in {result['measure_wall_s']} s; "
        + ", ".join(f"{k}={v:.3g}" for k, v in coef.items())
        + f"; r2={result['r2']:.3f}, median rel err {result['median_relative_error']:.1%}"
        + (f"; skipped {skipped}" if skipped else "")
    )
    llm.engine_core.shutdown()


def write_result(
    args: argparse.Namespace, samples: list[dict], skipped: list[str], wall_s: float
) -> dict:
    import torch

    result = {
        "model": "SmolLM2-135M-Instruct (embedded default)",
        "dtype": args.dtype,
        "machine": f"{platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} torch threads",
        "note": "measured on a noisy shared development VM (2 cores shared with other "
        "jobs, load average ~8 at the time): absolute times are several x a quiet "
        "machine's and vary run to run; the ratios between terms matter most to "
        "the routing simulator",
        "max_num_batched_tokens": 2048,
        "model_formula": "step_s = intercept_s + num_prefill_tokens * b + num_decode_reqs * c"
        " + num_decode_ctx_tokens * d",
        **fit_step_model(samples),
        "skipped_scenarios": skipped,
        "measure_wall_s": round(wall_s, 1),
        "samples": samples,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
