"""`kvserve bench serve --dataset-name mixed --mix`: the spec, a seeded mix of classes, each
class's targets as headers on its requests only, and the per-class report."""

from __future__ import annotations

import argparse

import pytest

from kvserve.benchmarks import serve
from kvserve.benchmarks.classes import (
    RequestClass,
    format_class_report,
    mixed_requests,
    parse_mix,
    summarize_classes,
)
from kvserve.benchmarks.endpoint_client import RequestRecord
from kvserve.benchmarks.metrics import compute_metrics
from kvserve.benchmarks.serve_runner import _request_specs, build_sources, parse_run_options

MIX = "short:12:4:0.9:ttft=600:tpot=90,long:40:4:0.1"


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def record(ttft: float, itl: list[float]) -> RequestRecord:
    return RequestRecord(
        success=True,
        prompt_len=10,
        start_time=100.0,
        ttft=ttft,
        itl=itl,
        latency=ttft + sum(itl),
        generated_text="x",
        output_tokens=len(itl) + 1,
    )


def test_spec_fields_and_errors():
    short, long = parse_mix(MIX)
    assert short == RequestClass("short", 12, 4, 0.9, 600.0, 90.0)
    assert long == RequestClass("long", 40, 4, 0.1)
    assert short.headers() == {"x-slo-ttft-ms": "600", "x-slo-tpot-ms": "90"}
    assert long.headers() == {} and long.targets() == {}
    for spec, message in (
        (None, "needs --mix"),
        ("short:12:4", "NAME:INPUT:OUTPUT:SHARE"),
        ("short:12.5:4:1", "whole token counts"),
        ("short:12:4:0", "SHARE must be a number > 0"),
        ("short:12:4:1:ttft=fast", "ttft must be a number > 0"),
        ("short:12:4:1:e2el=5", "ttft=MS or tpot=MS"),
        ("a:1:1:1,a:2:2:1", "appears twice"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_mix(spec)
    with pytest.raises(ValueError, match="--mix gives the classes of --dataset-name mixed"):
        parse_run_options(bench_args("--mix", MIX))


def test_mixed_requests_follow_the_shares_and_the_seed(tokenizer):
    classes = parse_mix(MIX)
    requests, record_classes = mixed_requests(tokenizer, 200, classes, seed=5)
    names = [c.name for c in record_classes]
    assert 160 <= names.count("short") <= 195 and names.count("long") == 200 - names.count("short")
    assert all(r.prompt_len == c.input_len for r, c in zip(requests, record_classes))
    assert all(r.expected_output_len == 4 for r in requests)
    again, again_classes = mixed_requests(tokenizer, 200, classes, seed=5)
    assert again == requests and again_classes == record_classes
    assert mixed_requests(tokenizer, 200, classes, seed=6)[1] != record_classes


def test_only_the_targeted_class_sends_target_headers(tokenizer):
    argv = ["--dataset-name", "mixed", "--mix", MIX, "--num-prompts", "30", "--request-rate", "5"]
    args = bench_args(*argv)
    options = parse_run_options(args)
    assert 50.0 in options.percentiles and 99.0 in options.percentiles
    [source] = build_sources(args, options, tokenizer)
    assert len(source.gaps) == 30 and all(gap > 0 for gap in source.gaps)
    specs = _request_specs(args, "http://x", "m", source)
    for spec, request_class in zip(specs, source.request_classes):
        assert spec.headers == request_class.headers()
        assert spec.prompt_len == request_class.input_len
    assert {spec.headers.get("x-slo-ttft-ms") for spec in specs} == {"600", None}
    assert source.request_slos() == [c.targets() for c in source.request_classes]
    # A baseline run sends no targets, and judges the same ones.
    quiet = bench_args(*argv, "--no-target-headers")
    [quiet_source] = build_sources(quiet, parse_run_options(quiet), tokenizer)
    assert quiet_source.request_slos() == source.request_slos()
    assert all(spec.headers == {} for spec in _request_specs(quiet, "http://x", "m", quiet_source))


def test_goodput_per_class_and_in_all(tokenizer):
    short, long = parse_mix(MIX)
    # Short: TTFT 100 ms (met), 700 ms (missed); long: no target, never judged.
    records = [record(0.1, [0.05, 0.05]), record(0.7, [0.05, 0.05]), record(3.0, [0.05, 0.05])]
    record_classes = [short, short, long]
    summary, _ = compute_metrics(
        records, tokenizer, 2.0, [50, 99], {}, 100.0, [c.targets() for c in record_classes]
    )
    assert summary["request_goodput"] == pytest.approx(1 / 2.0)
    results = summarize_classes([short, long], records, record_classes, tokenizer, 2.0, {}, 100.0)
    assert results["short"]["request_goodput"] == pytest.approx(1 / 2.0)
    assert results["short"]["num_requests"] == 2 and results["short"]["ttft_ms"] == 600.0
    assert results["long"]["request_goodput"] is None
    assert results["long"]["median_ttft_ms"] == pytest.approx(3000.0)
    # --goodput judges every request; a class's own target wins over it.
    results = summarize_classes(
        [short, long], records, record_classes, tokenizer, 2.0, {"ttft": 5000.0}, 100.0
    )
    assert results["short"]["request_goodput"] == pytest.approx(1 / 2.0)
    assert results["long"]["request_goodput"] == pytest.approx(1 / 2.0)
    lines = format_class_report(results, summary).splitlines()
    assert "Per-class Result" in lines[0] and lines[-1] == "=" * len(lines[0])
    assert lines[1].split()[:5] == ["Class", "P50", "TTFT", "P99", "TTFT"]
    rows = {line.split()[0]: line.split() for line in lines[2:-1]}
    assert set(rows) == {"short", "long", "all"}
    assert float(rows["long"][1]) == pytest.approx(3000.0) and rows["all"][-1] == "3"
    assert rows["all"][-2] == "0.500"
