"""The `kvserve bench` subcommands' parsers (each kind's module adds its own)."""

from __future__ import annotations


def add_bench_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    # Each kind imports its heavy modules (aiohttp, the engine, matplotlib) only when run.
    from kvserve.benchmarks import latency, plot, serve, throughput

    serve.add_parser(kinds)
    latency.add_parser(kinds)
    throughput.add_parser(kinds)
    plot.add_parser(kinds)
