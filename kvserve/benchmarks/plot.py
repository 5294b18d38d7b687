"""`kvserve bench plot RESULT.json ...`: PNG charts of `kvserve bench serve` results.

Always: one latency CDF per metric (TTFT, ITL, E2EL) with a curve per result. When the results
sweep the request rate (or, failing that, the max concurrency), also output throughput and
P99 TTFT against it, a line per label (e.g. kvserve vs vLLM).
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

import numpy as np

# metric -> (title, how to get its samples in ms from a result)
_CDF_METRICS = {
    "ttft": ("Time to first token", lambda r: [t * 1000 for t in _successful(r, "ttfts")]),
    "itl": (
        "Inter-token latency",
        lambda r: [gap * 1000 for gaps in _successful(r, "itls") for gap in gaps],
    ),
    "e2el": ("End-to-end latency", lambda r: [t * 1000 for t in _successful(r, "e2els")]),
}


def _successful(result: dict, key: str) -> list:
    """The per-request `key` values of the requests that did not fail."""
    values = result.get(key, [])
    errors = result.get("errors") or [""] * len(values)
    return [value for value, error in zip(values, errors) if not error]


def add_parser(kinds) -> None:
    p = kinds.add_parser("plot", help="PNG charts of `kvserve bench serve --save-result` JSONs")
    p.add_argument("results", nargs="+", help="result JSON files")
    p.add_argument("--output-dir", required=True, help="folder for the PNG files")
    p.set_defaults(func=run)


def _rate(result: dict) -> float | None:
    rate = result.get("request_rate")
    return None if rate in (None, "inf") or rate == float("inf") else float(rate)


def curve_name(result: dict, path: str) -> str:
    """The result's label (else its file name) and its load, e.g. 'kvserve c=32'."""
    name = result.get("label") or os.path.splitext(os.path.basename(path))[0]
    load = []
    if result.get("max_concurrency"):
        load.append(f"c={result['max_concurrency']}")
    if _rate(result) is not None:
        load.append(f"{_rate(result):g} req/s")
    return " ".join([name] + load)


def sweep_axis(results: list[dict]) -> str | None:
    """'request_rate' or 'max_concurrency' if the results differ by it, else None."""
    if len({_rate(r) for r in results if _rate(r) is not None}) > 1:
        return "request_rate"
    if len({r.get("max_concurrency") for r in results if r.get("max_concurrency")}) > 1:
        return "max_concurrency"
    return None


def _p99_ttft_ms(result: dict) -> float:
    samples = _CDF_METRICS["ttft"][1](result)
    return float(np.percentile(samples, 99)) if samples else float("nan")


def plot_cdfs(plt, named: list[tuple[str, dict]], output_dir: str) -> list[str]:
    paths = []
    for metric, (title, samples_of) in _CDF_METRICS.items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, result in named:
            samples = np.sort(samples_of(result))
            if samples.size:
                # Start each curve at 0 on its smallest sample, so it rises from the x axis.
                fractions = np.arange(samples.size + 1) / samples.size
                ax.step(np.concatenate([samples[:1], samples]), fractions, where="post", label=name)
        ax.set(
            title=f"{title} (CDF)",
            xlabel=f"{metric.upper()} (ms)",
            ylabel="fraction of samples",
            ylim=(0, 1.02),
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        paths.append(_save(fig, plt, os.path.join(output_dir, f"cdf_{metric}.png")))
    return paths


def plot_sweep(plt, named: list[tuple[str, dict]], axis: str, output_dir: str) -> list[str]:
    lines: dict[str, list[tuple[float, dict]]] = defaultdict(list)
    for name, result in named:
        x = _rate(result) if axis == "request_rate" else result.get("max_concurrency")
        if x is not None:
            lines[result.get("label") or name].append((float(x), result))
    xlabel = "request rate (req/s)" if axis == "request_rate" else "max concurrency"
    paths = []
    for key, ylabel, value_of in (
        ("output_throughput", "output tokens/s", lambda r: r["output_throughput"]),
        ("p99_ttft", "P99 TTFT (ms)", _p99_ttft_ms),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, points in sorted(lines.items()):
            points.sort(key=lambda point: point[0])
            ax.plot(
                [x for x, _ in points], [value_of(r) for _, r in points], marker="o", label=label
            )
        ax.set(title=f"{ylabel} vs {xlabel}", xlabel=xlabel, ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        paths.append(_save(fig, plt, os.path.join(output_dir, f"{key}_vs_{axis}.png")))
    return paths


def _save(fig, plt, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    named = []
    for path in args.results:
        try:
            with open(path) as f:
                result = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise SystemExit(f"kvserve bench plot: cannot read {path}: {exc}") from None
        if "ttfts" not in result:
            raise SystemExit(
                f"kvserve bench plot: {path} is not a `kvserve bench serve "
                "--save-result` JSON (it has no per-request ttfts)"
            )
        named.append((curve_name(result, path), result))
    os.makedirs(args.output_dir, exist_ok=True)
    paths = plot_cdfs(plt, named, args.output_dir)
    axis = sweep_axis([result for _, result in named])
    if axis is not None:
        paths += plot_sweep(plt, named, axis, args.output_dir)
    for path in paths:
        print(path)
    return 0
