"""The markdown summary of bench/run_agent_sitting.sh: per figure and server, each round's value
and the median and range over the rounds; per comparison, the ratio taken within each round
(the servers of one round ran back to back), its median and range.

    python bench/agent_sitting/summarize.py OUT_DIR > OUT_DIR/summary.md

Files in OUT_DIR are `{server}_r{round}.json`, `kvserve bench serve --dataset-name agent`
results, for the servers vllm, kvserve (prompt pins) and nopins (kvserve, LRU only).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

_NAME = re.compile(r"^(vllm|kvserve|nopins)_r(\d+)$")
SERVERS = ("vllm", "kvserve", "nopins")
FIGURES = (
    ("agent prefix hit rate (turns after the first)", "agent_prefix_hit_rate"),
    ("agent prefix hit rate (all turns)", "agent_prefix_hit_rate_all_turns"),
    ("agent P50 TTFT ms", "agent_ttft_p50_ms"),
    ("agent P90 TTFT ms", "agent_ttft_p90_ms"),
    ("agent turns", "agent_turns"),
    ("churn output tok/s", "churn_output_tok_per_s"),
    ("churn requests", "churn_requests"),
    ("errors", "num_errors"),
)
# (label, figure, numerator server, denominator server, target)
RATIOS = (
    ("agent P50 TTFT, kvserve / vLLM", "agent_ttft_p50_ms", "kvserve", "vllm", "<= 0.3"),
    ("churn output tok/s, pins / no pins", "churn_output_tok_per_s", "kvserve", "nopins", ">= 0.9"),
)


def _load(folder: Path) -> dict[tuple[str, int], dict]:
    runs = {}
    for path in sorted(folder.glob("*.json")):
        match = _NAME.match(path.stem)
        if match:
            runs[(match[1], int(match[2]))] = json.loads(path.read_text())
    return runs


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.4g} [{min(values):.4g}-{max(values):.4g}]"


def _figure_rows(runs: dict[tuple[str, int], dict], rounds: list[int]) -> list[str]:
    rows = []
    for label, key in FIGURES:
        for server in SERVERS:
            values = [runs[(server, r)].get(key) for r in rounds if (server, r) in runs]
            values = [v for v in values if v is not None]
            if values:
                each = ", ".join(f"{v:.4g}" for v in values)
                rows.append(f"| {label} | {server} | {each} | {_spread(values)} |")
    return rows


def _ratio_rows(runs: dict[tuple[str, int], dict], rounds: list[int]) -> list[str]:
    rows = []
    for label, key, top, bottom, target in RATIOS:
        ratios = []
        for r in rounds:
            a, b = runs.get((top, r), {}).get(key), runs.get((bottom, r), {}).get(key)
            if a is not None and b:
                ratios.append(a / b)
        each = ", ".join(f"{v:.3g}" for v in ratios) or "-"
        rows.append(f"| {label} | {each} | {_spread(ratios)} | {target} |")
    return rows


def main(folder: Path) -> str:
    runs = _load(folder)
    rounds = sorted({r for _, r in runs})
    lines = [
        "| figure | server | each round | median [range] |",
        "|---|---|---|---|",
        *_figure_rows(runs, rounds),
        "",
        "| ratio (within a round) | each round | median [range] | target |",
        "|---|---|---|---|",
        *_ratio_rows(runs, rounds),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(main(Path(sys.argv[1])))
