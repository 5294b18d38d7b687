"""The markdown summary of bench/run_slo_sitting.sh: per figure and server, each round's value
and the median and range over the rounds; per comparison, the ratio taken within each round
(the runs of one round ran back to back), its median and range.

    python bench/slo_sitting/summarize.py OUT_DIR > OUT_DIR/summary.md

Files in OUT_DIR are `{part}_{server}_r{round}_{run}.json`, `kvserve bench serve` results:
    a_{vllm,fcfs,slo}_rN_mixed        the two-class workload (short chats with targets)
    b_{vllm,fcfs,slo}_rN_{alone,doc}  chat streams, without / beside an 8,000-token document
    c_{vllm,fcfs,fairslo}_rN_{mix,alone}  issue 28's tenants, and the light tenant alone
    d_{before,after}_rN_c32           no targets, concurrency 32
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

_NAME = re.compile(r"^([abcd])_([a-z]+)_r(\d+)_([a-z0-9]+)$")
Runs = dict[tuple[str, str, int, str], dict]
# A figure: (label, part, run, reader of the run's result).
Figure = tuple[str, str, str, Callable[[dict], float | None]]


def _class(name: str, key: str) -> Callable[[dict], float | None]:
    return lambda result: result.get("classes", {}).get(name, {}).get(key)


def _tenant(name: str, key: str) -> Callable[[dict], float | None]:
    return lambda result: result.get("tenants", {}).get(name, {}).get(key)


def _top(key: str) -> Callable[[dict], float | None]:
    return lambda result: result.get(key)


PART_A: list[Figure] = [
    ("goodput req/s (short class, its targets)", "a", "mixed", _class("short", "request_goodput")),
    ("short P50 TTFT ms", "a", "mixed", _class("short", "p50_ttft_ms")),
    ("short P99 TTFT ms", "a", "mixed", _class("short", "p99_ttft_ms")),
    ("short P50 TPOT ms", "a", "mixed", _class("short", "p50_tpot_ms")),
    ("short P99 TPOT ms", "a", "mixed", _class("short", "p99_tpot_ms")),
    ("short P99 ITL ms", "a", "mixed", _class("short", "p99_itl_ms")),
    ("long P50 TTFT ms", "a", "mixed", _class("long", "p50_ttft_ms")),
    ("long P99 TTFT ms", "a", "mixed", _class("long", "p99_ttft_ms")),
    ("long P99 TPOT ms", "a", "mixed", _class("long", "p99_tpot_ms")),
    ("all: out tok/s", "a", "mixed", _top("output_throughput")),
    ("all: failed", "a", "mixed", _top("failed")),
]
PART_B: list[Figure] = [
    ("chat P99 ITL ms, alone", "b", "alone", _class("chat", "p99_itl_ms")),
    ("chat P99 ITL ms, beside the document", "b", "doc", _class("chat", "p99_itl_ms")),
]
PART_C: list[Figure] = [
    ("light P99 TTFT ms, beside heavy", "c", "mix", _tenant("light", "p99_ttft_ms")),
    ("light P99 TTFT ms, alone", "c", "alone", _tenant("light", "p99_ttft_ms")),
    ("heavy out tok/s", "c", "mix", _tenant("heavy", "output_throughput")),
]
PART_D: list[Figure] = [("out tok/s, c32 256/128", "d", "c32", _top("output_throughput"))]


def load(out_dir: Path) -> Runs:
    """(part, server, round, run) -> the bench result."""
    runs: Runs = {}
    for path in sorted(out_dir.glob("*.json")):
        match = _NAME.match(path.stem)
        if match is not None:
            part, server, rnd, run = match.groups()
            runs[(part, server, int(rnd), run)] = json.loads(path.read_text())
    return runs


def _values(values: list[float]) -> str:
    if not values:
        return "-"
    median = statistics.median(values)
    text = f"{_number(median)} [{_number(min(values))}-{_number(max(values))}]"
    return text if len(values) > 1 else _number(values[0])


def _number(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _series(runs: Runs, figure: Figure, server: str, rounds: list[int]) -> list[float | None]:
    _, part, run, read = figure
    return [
        read(runs[key]) if (key := (part, server, rnd, run)) in runs else None for rnd in rounds
    ]


def figure_table(runs: Runs, figures: list[Figure], servers: list[str]) -> list[str]:
    """One row per figure: each server's median [range] over the rounds."""
    rounds = sorted({key[2] for key in runs})
    lines = ["| figure | " + " | ".join(servers) + " |", "|---" * (len(servers) + 1) + "|"]
    for figure in figures:
        cells = []
        for server in servers:
            values = [v for v in _series(runs, figure, server, rounds) if v is not None]
            cells.append(_values(values))
        lines.append(f"| {figure[0]} | " + " | ".join(cells) + " |")
    return lines


def ratio_row(runs: Runs, label: str, top: tuple[Figure, str], bottom: tuple[Figure, str]) -> str:
    """A ratio of two (figure, server) series taken within each round: median [range]."""
    rounds = sorted({key[2] for key in runs})
    tops = _series(runs, top[0], top[1], rounds)
    bottoms = _series(runs, bottom[0], bottom[1], rounds)
    ratios = [t / b for t, b in zip(tops, bottoms) if t is not None and b]
    return f"| {label} | {_values(ratios)} | {len(ratios)} |"


def summarize(runs: Runs) -> str:
    """The whole markdown summary."""
    lines = ["# SLO sitting", "", "Median [range] over the rounds.", ""]
    lines += ["## (a) two-class workload", ""]
    lines += figure_table(runs, PART_A, ["vllm", "fcfs", "slo"])
    goodput = PART_A[0]
    lines += ["", "| ratio (within a round) | median [range] | rounds |", "|---|---|---|"]
    lines.append(ratio_row(runs, "goodput: targets / vLLM", (goodput, "slo"), (goodput, "vllm")))
    lines.append(ratio_row(runs, "goodput: targets / fcfs", (goodput, "slo"), (goodput, "fcfs")))
    lines += ["", "## (b) chat streams beside an 8,000-token document", ""]
    lines += figure_table(runs, PART_B, ["vllm", "fcfs", "slo"])
    lines += ["", "| ratio (within a round) | median [range] | rounds |", "|---|---|---|"]
    for server in ("vllm", "fcfs", "slo"):
        label = f"{server}: ITL P99 beside / alone"
        lines.append(ratio_row(runs, label, (PART_B[1], server), (PART_B[0], server)))
    lines += ["", "## (c) issue 28's tenants", ""]
    lines += figure_table(runs, PART_C, ["vllm", "fcfs", "fairslo"])
    lines += ["", "| ratio (within a round) | median [range] | rounds |", "|---|---|---|"]
    for server in ("vllm", "fcfs", "fairslo"):
        label = f"{server}: light P99 TTFT beside / alone"
        lines.append(ratio_row(runs, label, (PART_C[0], server), (PART_C[1], server)))
    lines += ["", "## (d) no targets, concurrency 32", ""]
    lines += figure_table(runs, PART_D, ["before", "after"])
    lines += ["", "| ratio (within a round) | median [range] | rounds |", "|---|---|---|"]
    d = PART_D[0]
    lines.append(ratio_row(runs, "tok/s: after / before", (d, "after"), (d, "before")))
    return "\n".join(lines) + "\n"


def main() -> None:
    print(summarize(load(Path(sys.argv[1]))), end="")


if __name__ == "__main__":
    main()
