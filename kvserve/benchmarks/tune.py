"""`kvserve tune`: the serving configuration with the highest goodput that meets the SLOs.

The shape of vLLM's auto-tune script: for every combination of --max-num-seqs,
--max-num-batched-tokens and --long-prefill-token-threshold it starts a fresh `kvserve serve`,
then runs `kvserve bench serve` over the workload at each --request-rate, highest first, and
stops at the first rate whose percentiles meet every --slo (a lower rate cannot serve more
requests a second). A run's goodput is the requests per second that met the SLOs one by one
(bench serve's request goodput with the same bounds). The winner is the feasible run with the
highest goodput; its command line is printed, and the whole sweep is written to
OUTPUT_DIR/tune.json and plotted in OUTPUT_DIR/tune.png.

    kvserve tune --model MODEL --slo ttft_p99_ms=500 --slo tpot_p99_ms=50 \\
        --max-num-seqs 16 32 64 --max-num-batched-tokens 1024 2048 --request-rate inf 8 4 2
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

from kvserve.benchmarks.serve import add_dataset_args
from kvserve.benchmarks.serve import add_parser as add_bench_serve_parser

logger = logging.getLogger(__name__)

# The metrics and statistics an SLO may bound (bench serve's summary keys: p99_ttft_ms, ...).
_METRICS = ("ttft", "tpot", "itl", "e2el")
_STATISTICS = ("mean", "median", "max")
_START_TIMEOUT_S = 600.0


def add_tune_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "tune",
        help="sweep the scheduler flags and the request rate for the best goodput within SLOs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=None, help="what `kvserve serve` serves (default: its own)")
    p.add_argument(
        "--serve-args",
        default="",
        help="more `kvserve serve` flags for every server, as one string, e.g. '--dtype bfloat16'",
    )
    p.add_argument(
        "--slo",
        action="append",
        default=[],
        metavar="METRIC_STAT_ms=MS",
        help="a bound, e.g. ttft_p99_ms=500, tpot_p99_ms=50, e2el_mean_ms=4000 (repeatable)",
    )
    sweep = p.add_argument_group("sweep")
    sweep.add_argument("--max-num-seqs", type=int, nargs="+", default=[16, 32, 64])
    sweep.add_argument("--max-num-batched-tokens", type=int, nargs="+", default=[1024, 2048])
    sweep.add_argument("--long-prefill-token-threshold", type=int, nargs="+", default=[0])
    sweep.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=[float("inf"), 8.0, 4.0, 2.0, 1.0],
        help="rates to try per configuration, highest first (inf: all at once)",
    )
    load = p.add_argument_group("load")
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument("--ignore-eos", action="store_true")
    load.add_argument("--endpoint", default="/v1/completions")
    load.add_argument("--tokenizer", default=None, help="as in `kvserve bench serve`")
    add_dataset_args(p)
    p.add_argument("--port", type=int, default=None, help="servers' port (default: a free one)")
    p.add_argument("--output-dir", default="tune-results")
    p.set_defaults(func=run, num_prompts=100)


def parse_slos(items: list[str]) -> dict[str, float]:
    """['ttft_p99_ms=500'] -> {'p99_ttft_ms': 500.0}: bench serve's summary keys."""
    slos = {}
    for item in items:
        key, sep, value = item.partition("=")
        parts = key.split("_")
        if not sep or len(parts) != 3 or parts[0] not in _METRICS or parts[2] != "ms":
            raise ValueError(f"--slo takes METRIC_STAT_ms=MS (e.g. ttft_p99_ms=500), got {item!r}")
        metric, stat = parts[0], parts[1]
        if stat not in _STATISTICS and not (stat.startswith("p") and _is_number(stat[1:])):
            raise ValueError(f"--slo {item!r}: the statistic is mean, median, max or pNN")
        try:
            bound = float(value)
        except ValueError:
            raise ValueError(f"--slo {item!r}: {value!r} is not a number of ms") from None
        slos[f"{stat}_{metric}_ms"] = bound
    if not slos:
        raise ValueError("give at least one --slo, e.g. --slo ttft_p99_ms=500")
    return slos


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _percentiles(slos: dict[str, float]) -> list[str]:
    """The percentiles bench serve must report for these SLOs ('p99_ttft_ms' -> '99')."""
    wanted = {"99"}
    for key in slos:
        stat = key.split("_")[0]
        if stat.startswith("p"):
            wanted.add(stat[1:])
    return sorted(wanted, key=float)


def _goodput_bounds(slos: dict[str, float]) -> list[str]:
    """Per-request bounds for bench serve's --goodput: the tightest SLO of each metric."""
    bounds: dict[str, float] = {}
    for key, value in slos.items():
        metric = key.split("_")[1]
        if metric != "itl":  # goodput has no per-request ITL
            bounds[metric] = min(value, bounds.get(metric, value))
    return [f"{metric}:{value:g}" for metric, value in bounds.items()]


def meets(summary: dict, slos: dict[str, float]) -> bool:
    return all(summary.get(key, float("inf")) <= bound for key, bound in slos.items())


def serve_command(args: argparse.Namespace, config: dict) -> list[str]:
    """The `kvserve serve` argv of one configuration (without the port)."""
    argv = ["kvserve", "serve"]
    if args.model:
        argv += ["--model", args.model]
    argv += [
        "--max-num-seqs",
        str(config["max_num_seqs"]),
        "--max-num-batched-tokens",
        str(config["max_num_batched_tokens"]),
        "--long-prefill-token-threshold",
        str(config["long_prefill_token_threshold"]),
    ]
    return argv + shlex.split(args.serve_args)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(process: subprocess.Popen, port: int, log_path: str) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not healthy after {_START_TIMEOUT_S:.0f} s; see {log_path}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _bench_args(args: argparse.Namespace, port: int, rate: float, slos: dict) -> argparse.Namespace:
    """The `kvserve bench serve` flags of one run, parsed by its own parser."""
    parser = argparse.ArgumentParser()
    add_bench_serve_parser(parser.add_subparsers())
    argv = [
        "serve",
        "--port",
        str(port),
        "--endpoint",
        args.endpoint,
        "--request-rate",
        str(rate),
        "--dataset-name",
        args.dataset_name,
        "--num-prompts",
        str(args.num_prompts),
        "--seed",
        str(args.seed),
        "--random-input-len",
        str(args.random_input_len),
        "--random-output-len",
        str(args.random_output_len),
        "--random-range-ratio",
        str(args.random_range_ratio),
        "--prefix-num-groups",
        str(args.prefix_num_groups),
        "--prefix-len",
        str(args.prefix_len),
        "--prefix-suffix-len",
        str(args.prefix_suffix_len),
        "--prefix-output-len",
        str(args.prefix_output_len),
        "--metric-percentiles",
        ",".join(_percentiles(slos)),
        "--disable-tqdm",
    ]
    goodput = _goodput_bounds(slos)
    if goodput:
        argv += ["--goodput", *goodput]
    for flag, value in (
        ("--dataset-path", args.dataset_path),
        ("--sharegpt-output-len", args.sharegpt_output_len),
        ("--max-concurrency", args.max_concurrency),
        ("--tokenizer", args.tokenizer),
        ("--mix", args.mix),
    ):
        if value is not None:
            argv += [flag, str(value)]
    if args.ignore_eos:
        argv.append("--ignore-eos")
    return parser.parse_args(argv)


def _bench(bench_args: argparse.Namespace, tokenizer) -> dict:
    from kvserve.benchmarks.serve_runner import benchmark, build_sources, parse_run_options

    options = parse_run_options(bench_args)
    sources = build_sources(bench_args, options, tokenizer)
    base_url = f"http://127.0.0.1:{bench_args.port}"
    return asyncio.run(benchmark(bench_args, options, base_url, sources, tokenizer))


_SUMMARY_KEYS = ("completed", "failed", "request_throughput", "output_throughput")


def run_config(
    args: argparse.Namespace, config: dict, slos: dict[str, float], tokenizer, index: int
) -> dict:
    """Start one configuration's server, run the rates until one meets the SLOs, stop it."""
    port = args.port or _free_port()
    command = serve_command(args, config)
    log_path = os.path.join(args.output_dir, f"server-{index}.log")
    logger.info("tune: configuration %d: %s", index, shlex.join(command))
    entry: dict[str, Any] = {
        "config": config,
        "command": shlex.join(command),
        "runs": [],
        "error": None,
    }
    argv = [sys.executable, "-m", "kvserve.cli", *command[1:], "--port", str(port)]
    with open(log_path, "w") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(process, port, log_path)
        for rate in args.request_rate:
            result = _bench(_bench_args(args, port, rate, slos), tokenizer)
            summary = {key: result.get(key) for key in _SUMMARY_KEYS}
            summary.update({key: result.get(key) for key in slos})
            goodput = result.get("request_goodput") or 0.0
            ok = meets(result, slos) and result["failed"] == 0
            entry["runs"].append(
                {
                    "request_rate": "inf" if rate == float("inf") else rate,
                    "meets_slos": ok,
                    "goodput": goodput,
                    **summary,
                }
            )
            logger.info(
                "tune: configuration %d at %s req/s: goodput %.3f req/s, %s the SLOs",
                index,
                rate,
                goodput,
                "meets" if ok else "misses",
            )
            if ok:
                break
    except RuntimeError as exc:
        entry["error"] = str(exc)
        logger.warning("tune: configuration %d failed: %s", index, exc)
    finally:
        _stop(process)
    return entry


def best_run(sweep: list[dict]) -> tuple[dict, dict] | None:
    """(configuration entry, run) with the highest goodput among runs meeting the SLOs."""
    feasible = [(entry, r) for entry in sweep for r in entry["runs"] if r["meets_slos"]]
    if not feasible:
        return None
    return max(feasible, key=lambda pair: (pair[1]["goodput"], pair[1]["output_throughput"]))


def plot(sweep: list[dict], path: str) -> bool:
    """Bars of the best feasible goodput of each configuration (grey: none met the SLOs)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("tune: matplotlib is not installed (pip install 'kvserve[bench]'): no plot")
        return False
    labels, values, colors = [], [], []
    for entry in sweep:
        c = entry["config"]
        labels.append(
            f"seqs {c['max_num_seqs']}\ntok {c['max_num_batched_tokens']}\n"
            f"long {c['long_prefill_token_threshold']}"
        )
        good = [r for r in entry["runs"] if r["meets_slos"]]
        values.append(max((r["goodput"] for r in good), default=0.0))
        colors.append("tab:blue" if good else "lightgrey")
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(labels)), 4))
    ax.bar(range(len(labels)), values, color=colors)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("goodput within SLOs (req/s)")
    ax.set_title("kvserve tune")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def run(args: argparse.Namespace) -> int:
    from kvserve.benchmarks import datasets

    try:
        slos = parse_slos(args.slo)
    except ValueError as exc:
        raise SystemExit(f"kvserve tune: {exc}") from None
    os.makedirs(args.output_dir, exist_ok=True)
    tokenizer = datasets.load_tokenizer(args.tokenizer)
    configs = [
        {"max_num_seqs": s, "max_num_batched_tokens": t, "long_prefill_token_threshold": long}
        for s, t, long in itertools.product(
            args.max_num_seqs, args.max_num_batched_tokens, args.long_prefill_token_threshold
        )
    ]
    sweep = [run_config(args, c, slos, tokenizer, i) for i, c in enumerate(configs)]
    best = best_run(sweep)
    report = {
        "slos": slos,
        "sweep": sweep,
        "best": None if best is None else {**best[0], "run": best[1]},
    }
    json_path = os.path.join(args.output_dir, "tune.json")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2)
    plotted = plot(sweep, os.path.join(args.output_dir, "tune.png"))
    print(f"sweep written to {json_path}" + (" and tune.png" if plotted else ""))
    if best is None:
        print("no configuration met the SLOs; loosen them or sweep lower request rates")
        return 1
    entry, best_rate = best
    print(
        f"best: goodput {best_rate['goodput']:.3f} req/s at {best_rate['request_rate']} req/s, "
        f"output {best_rate['output_throughput']:.1f} tok/s"
    )
    print(entry["command"])
    return 0
