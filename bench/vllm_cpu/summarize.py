"""The side-by-side summary of bench/run_vllm_cpu.sh: each round's kvserve / vLLM ratio per
metric, and the median and range of those ratios over the rounds.

    python bench/vllm_cpu/summarize.py OUT_DIR

Files in OUT_DIR are named `{system}_{dtype}_r{round}_{workload}` (.json for the serve runs,
.txt for the offline runs, whose "N output tokens/s" line both systems print alike,
_startup.txt for the seconds to a healthy server). A ratio is taken only between the two
systems' runs of one round, which ran back to back.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

_NAME = re.compile(
    r"^(kvserve|vllm)_(float32|bfloat16)_r(\d+)_(c32|rate2|b1|long_cold|long_warm|throughput|startup)$"
)
_OFFLINE = re.compile(r"([\d.]+) output tokens/s")

# (workload, metric, what it is, higher is better)
METRICS = [
    ("throughput", "output_tokens_per_second", "offline out tok/s", True),
    ("c32", "output_throughput", "c32 out tok/s", True),
    ("c32", "p99_ttft_ms", "c32 P99 TTFT ms", False),
    ("c32", "mean_tpot_ms", "c32 mean TPOT ms", False),
    ("rate2", "p99_ttft_ms", "2/s P99 TTFT ms", False),
    ("rate2", "p99_itl_ms", "2/s P99 ITL ms", False),
    ("rate2", "failed", "2/s failed", False),
    ("b1", "mean_tpot_ms", "batch-1 mean TPOT ms", False),
    ("b1", "mean_ttft_ms", "batch-1 mean TTFT ms", False),
    ("long_cold", "mean_ttft_ms", "long prompt TTFT ms", False),
    ("long_warm", "mean_ttft_ms", "long again TTFT ms", False),
    ("startup", "seconds", "start to healthy s", False),
]


def load(out_dir: Path) -> dict[tuple[str, str, int, str], dict[str, float]]:
    """(system, dtype, round, workload) -> metrics."""
    runs: dict[tuple[str, str, int, str], dict[str, float]] = {}
    for path in sorted(out_dir.iterdir()):
        match = _NAME.match(path.stem)
        if match is None:
            continue
        system, dtype, rnd, workload = match.groups()
        key = (system, dtype, int(rnd), workload)
        if workload in ("c32", "rate2", "b1", "long_cold", "long_warm") and path.suffix == ".json":
            runs[key] = json.loads(path.read_text())
        elif workload == "throughput" and path.suffix == ".txt":
            found = _OFFLINE.findall(path.read_text())
            if found:
                runs[key] = {"output_tokens_per_second": float(found[-1])}
        elif workload == "startup" and path.suffix == ".txt":
            runs[key] = {"seconds": float(path.read_text().strip())}
    return runs


def summarize(runs: dict[tuple[str, str, int, str], dict[str, float]]) -> str:
    lines = []
    header = f"{'dtype':<9} {'metric':<20} {'kvserve per round':<26} {'vLLM per round':<26}"
    lines.append(header + " kvserve/vLLM median [range]")
    dtypes = sorted({key[1] for key in runs}, key=["float32", "bfloat16"].index)
    rounds = sorted({key[2] for key in runs})
    for dtype in dtypes:
        for workload, metric, label, higher_better in METRICS:
            ours, theirs, ratios = [], [], []
            for rnd in rounds:
                a = runs.get(("kvserve", dtype, rnd, workload), {}).get(metric)
                b = runs.get(("vllm", dtype, rnd, workload), {}).get(metric)
                if a is not None:
                    ours.append(a)
                if b is not None:
                    theirs.append(b)
                if a is not None and b:
                    ratios.append(a / b)
            if not ours and not theirs:
                continue
            cell = f"{dtype:<9} {label:<20} {_values(ours):<26} {_values(theirs):<26}"
            if ratios:
                better = "higher" if higher_better else "lower"
                cell += (
                    f" {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
                    f" ({better} is better)"
                )
            lines.append(cell)
    return "\n".join(lines)


def _values(values: list[float]) -> str:
    return " ".join(f"{v:.0f}" if v >= 100 else f"{v:.1f}" for v in values) or "-"


def main() -> None:
    print(summarize(load(Path(sys.argv[1]))))


if __name__ == "__main__":
    main()
