"""`kvserve bench {throughput, ...}`: vLLM's benchmark tools, for kvserve and other servers."""

from __future__ import annotations

import argparse


def add_bench_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    from kvserve.benchmarks import throughput

    throughput.add_parser(kinds)
