"""The table of bench/run_fairness.sh's runs: per data-parallel size and configuration, the
light tenant's TTFT (P50, P99; P99 against the light tenant alone), the heavy tenant's, and
the total output tok/s (against fcfs), one row per round and the median of the ratios.

    .venv/bin/python bench/fairness_report.py bench/results/fairness-YYYYMMDD-HHMMSS
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

_NAME = re.compile(r"^r(?P<round>\d+)-dp(?P<dp>\d+)-(?P<config>\w+)\.json$")


def load(folder: Path) -> dict[tuple[int, int, str], dict]:
    """(round, dp, config) -> the bench result JSON."""
    runs = {}
    for path in sorted(folder.glob("r*-dp*-*.json")):
        match = _NAME.match(path.name)
        if match:
            key = (int(match["round"]), int(match["dp"]), match["config"])
            runs[key] = json.loads(path.read_text())
    return runs


def rows(runs: dict[tuple[int, int, str], dict]) -> list[str]:
    lines = [
        "| DP | config | round | light TTFT P50 / P99 | light P99 / alone | heavy TTFT P50 / P99 "
        "| output tok/s | / fcfs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ratios: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for (round_, dp, config), result in sorted(runs.items()):
        if config == "alone":
            continue
        light = result["tenants"]["light"]
        heavy = result["tenants"]["heavy"]
        alone = runs.get((round_, dp, "alone"), {}).get("tenants", {}).get("light")
        fcfs = runs.get((round_, dp, "fcfs"))
        vs_alone = light["p99_ttft_ms"] / alone["p99_ttft_ms"] if alone else float("nan")
        vs_fcfs = result["output_throughput"] / fcfs["output_throughput"] if fcfs else float("nan")
        ratios.setdefault((dp, config), []).append((vs_alone, vs_fcfs))
        lines.append(
            f"| {dp} | {config} | {round_} | {light['p50_ttft_ms']:,.0f} / "
            f"{light['p99_ttft_ms']:,.0f} ms | {vs_alone:.1f}x "
            f"(alone {alone['p99_ttft_ms'] if alone else float('nan'):,.0f} ms) | "
            f"{heavy['p50_ttft_ms']:,.0f} / {heavy['p99_ttft_ms']:,.0f} ms | "
            f"{result['output_throughput']:.1f} | {vs_fcfs:.2f}x |"
        )
    lines.append("")
    lines.append("| DP | config | light P99 / alone (median, range) | output tok/s / fcfs |")
    lines.append("|---|---|---|---|")
    for (dp, config), pairs in sorted(ratios.items()):
        alone_ratios = [a for a, _ in pairs]
        fcfs_ratios = [f for _, f in pairs]
        lines.append(
            f"| {dp} | {config} | {statistics.median(alone_ratios):.1f}x "
            f"({min(alone_ratios):.1f}-{max(alone_ratios):.1f}) | "
            f"{statistics.median(fcfs_ratios):.2f}x ({min(fcfs_ratios):.2f}-"
            f"{max(fcfs_ratios):.2f}) |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="run_fairness.sh's OUT_DIR")
    options = parser.parse_args()
    print("\n".join(rows(load(options.folder))))


if __name__ == "__main__":
    main()
