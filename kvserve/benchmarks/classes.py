"""`kvserve bench serve --dataset-name mixed --mix SPEC`: a workload of request classes.

The spec lists the classes, separated by `,`; each is `NAME:INPUT:OUTPUT:SHARE`, then
optionally `:ttft=MS` and `:tpot=MS`, the class's latency targets:

    short:128:64:0.9:ttft=600:tpot=90,long:4096:64:0.1

    INPUT   prompt tokens (random tokens, as --dataset-name random)
    OUTPUT  max_tokens
    SHARE   the class's share of the --num-prompts requests (the shares are normalized)
    ttft, tpot   sent with each of the class's requests as the x-slo-ttft-ms /
            x-slo-tpot-ms headers (kvserve's latency targets; a server without them, as
            vLLM, ignores headers), and the class's goodput targets in the report

Which class each request belongs to is drawn with --seed, in arrival order, so a run is the
same workload against every server; arrivals are --request-rate's Poisson process. The report
splits TTFT, TPOT and ITL percentiles and goodput per class (goodput as vLLM defines it: the
requests per second that met every target they had, the class's over --goodput's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvserve.benchmarks import datasets
from kvserve.benchmarks.endpoint_client import RequestRecord
from kvserve.benchmarks.metrics import compute_metrics

# The per-class table: these percentiles of these metrics, then goodput.
CLASS_PERCENTILES = (50.0, 99.0)
CLASS_METRICS = ("ttft", "tpot", "itl")
TTFT_HEADER = "x-slo-ttft-ms"
TPOT_HEADER = "x-slo-tpot-ms"


@dataclass(frozen=True)
class RequestClass:
    """One class of a --mix workload.

    Args:
        name: its name in the report.
        input_len: prompt tokens.
        output_len: max_tokens.
        share: its share of the requests (before normalizing).
        ttft_ms: its TTFT target (None: none).
        tpot_ms: its TPOT target (None: none).
    """

    name: str
    input_len: int
    output_len: int
    share: float
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def targets(self) -> dict[str, float]:
        """Its targets as goodput SLOs ({'ttft': ms, 'tpot': ms}, those it has)."""
        found = {"ttft": self.ttft_ms, "tpot": self.tpot_ms}
        return {name: ms for name, ms in found.items() if ms is not None}

    def headers(self) -> dict[str, str]:
        """The headers that carry its targets to the server."""
        found = {TTFT_HEADER: self.ttft_ms, TPOT_HEADER: self.tpot_ms}
        return {name: f"{ms:g}" for name, ms in found.items() if ms is not None}

    def config(self) -> dict:
        return {
            "input_len": self.input_len,
            "output_len": self.output_len,
            "share": self.share,
            "ttft_ms": self.ttft_ms,
            "tpot_ms": self.tpot_ms,
        }


def _number(text: str, what: str, entry: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"--mix: {what} must be a number > 0, got {text!r} in {entry!r}")
    return value


def _parse_class(entry: str) -> RequestClass:
    parts = [part.strip() for part in entry.split(":")]
    if len(parts) < 4:
        raise ValueError(
            f"--mix: expected NAME:INPUT:OUTPUT:SHARE[:ttft=MS][:tpot=MS], got {entry!r}"
        )
    name, input_len, output_len, share = parts[:4]
    if not name:
        raise ValueError(f"--mix: a class needs a name, in {entry!r}")
    lens = [
        _number(text, what, entry) for text, what in ((input_len, "INPUT"), (output_len, "OUTPUT"))
    ]
    if any(not value.is_integer() for value in lens):
        raise ValueError(f"--mix: INPUT and OUTPUT are whole token counts, in {entry!r}")
    targets: dict[str, float] = {}
    for part in parts[4:]:
        key, sep, value = part.partition("=")
        if not sep or key not in ("ttft", "tpot") or key in targets:
            raise ValueError(f"--mix: expected ttft=MS or tpot=MS (once each), got {part!r}")
        targets[key] = _number(value, key, entry)
    return RequestClass(
        name,
        int(lens[0]),
        int(lens[1]),
        _number(share, "SHARE", entry),
        targets.get("ttft"),
        targets.get("tpot"),
    )


def parse_mix(text: str | None) -> list[RequestClass]:
    """The classes of a --mix spec, in its order (see the module docstring)."""
    if not text:
        raise ValueError("--dataset-name mixed needs --mix, e.g. short:128:64:0.9,long:4096:64:0.1")
    classes = [_parse_class(entry) for entry in text.split(",") if entry.strip()]
    names = [c.name for c in classes]
    if len(set(names)) != len(names):
        raise ValueError(f"--mix: a class name appears twice in {text!r}")
    if not classes:
        raise ValueError(f"--mix names no class: {text!r}")
    return classes


def mixed_requests(
    tokenizer, num_prompts: int, classes: list[RequestClass], seed: int
) -> tuple[list[datasets.SampleRequest], list[RequestClass]]:
    """The requests of a mixed run in arrival order, and each one's class.

    Args:
        tokenizer: the benchmark's tokenizer.
        num_prompts: requests in all.
        classes: the workload's classes.
        seed: draws each request's class, and seeds each class's prompts.
    """
    shares = np.array([c.share for c in classes], dtype=np.float64)
    picks = np.random.default_rng(seed).choice(len(classes), num_prompts, p=shares / shares.sum())
    prompts_of = {
        index: iter(
            datasets.random_requests(
                tokenizer,
                int((picks == index).sum()),
                request_class.input_len,
                request_class.output_len,
                seed=seed + 1 + index,
            )
        )
        for index, request_class in enumerate(classes)
        if (picks == index).any()
    }
    requests = [next(prompts_of[index]) for index in picks.tolist()]
    return requests, [classes[index] for index in picks.tolist()]


def summarize_classes(
    classes: list[RequestClass],
    records: list[RequestRecord],
    record_classes: list[RequestClass],
    tokenizer,
    duration_s: float,
    slos: dict[str, float],
    bench_start: float,
) -> dict[str, dict]:
    """Each class's figures: its spec fields and the summary of its own records.

    Args:
        classes: the workload's classes.
        records: every request's record, in arrival order.
        record_classes: each record's class.
        tokenizer: counts output tokens when the server sent no usage.
        duration_s: the whole run's duration (each class's rates are over it).
        slos: --goodput's SLOs (a class's targets win over them).
        bench_start: perf_counter() at the start of the run.
    """
    results = {}
    for request_class in classes:
        mine = [r for r, c in zip(records, record_classes) if c is request_class]
        if not mine:
            continue
        summary, _ = compute_metrics(
            mine,
            tokenizer,
            duration_s,
            list(CLASS_PERCENTILES),
            slos | request_class.targets(),
            bench_start,
        )
        results[request_class.name] = {
            **request_class.config(),
            "num_requests": len(mine),
            **summary,
        }
    return results


def format_class_report(class_results: dict[str, dict], overall: dict) -> str:
    """The per-class table: P50 / P99 of TTFT, TPOT and ITL, and goodput, per class and in
    all (`overall` is the run's summary, which holds at least CLASS_PERCENTILES)."""
    rows = {**class_results, "all": overall}
    name_width = max(6, *(len(name) for name in rows))
    headers = [f"P{p:g} {m.upper()}" for m in CLASS_METRICS for p in CLASS_PERCENTILES]
    headers += ["Good req/s", "Requests"]
    width = name_width + 11 * len(headers)
    lines = [
        f"{' Per-class Result (ms) ':=^{width}}",
        f"{'Class':<{name_width}}" + "".join(f"{h:>11}" for h in headers),
    ]
    for name, result in rows.items():
        cells = [
            f"{result[f'p{p:g}_{m}_ms']:.2f}" for m in CLASS_METRICS for p in CLASS_PERCENTILES
        ]
        goodput = result["request_goodput"]
        cells.append("-" if goodput is None else f"{goodput:.3f}")
        cells.append(str(result["completed"] + result["failed"]))
        lines.append(f"{name:<{name_width}}" + "".join(f"{cell:>11}" for cell in cells))
    lines.append("=" * width)
    return "\n".join(lines)
