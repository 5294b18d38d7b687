"""The serving benchmark's metric math: percentiles, TPOT, goodput, throughputs, report."""

from __future__ import annotations

import numpy as np
import pytest

from kvserve.benchmarks.endpoint_client import RequestRecord
from kvserve.benchmarks.metrics import (
    compute_metrics,
    format_report,
    meets_slos,
    parse_goodput,
    parse_metric_percentiles,
    parse_percentile_metrics,
    percentile_key,
)


def record(
    ttft: float, itl: list[float], output_tokens: int | None, text: str = "x", start: float = 100.0
) -> RequestRecord:
    return RequestRecord(
        success=True,
        prompt_len=10,
        start_time=start,
        ttft=ttft,
        itl=itl,
        latency=ttft + sum(itl),
        generated_text=text,
        output_tokens=output_tokens,
    )


def failed(error: str = "HTTP 500: boom") -> RequestRecord:
    return RequestRecord(prompt_len=10, start_time=100.5, error=error)


def test_percentile_names_and_parsing():
    assert percentile_key(99.0) == "99" and percentile_key(99.9) == "99.9"
    assert parse_metric_percentiles("50, 90,99.9") == [50.0, 90.0, 99.9]
    assert parse_percentile_metrics("ttft,e2el") == ["ttft", "e2el"]
    for bad in ("0", "101", "p99", ""):
        with pytest.raises(ValueError, match="--metric-percentiles"):
            parse_metric_percentiles(bad)
    with pytest.raises(ValueError, match="--percentile-metrics"):
        parse_percentile_metrics("ttft,latency")


def test_goodput_parsing():
    assert parse_goodput(["ttft:200", "e2el:1500.5"]) == {"ttft": 200.0, "e2el": 1500.5}
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft"], ["ttft:fast"], ["tpot:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_summary_matches_numpy_and_counts_failures(tokenizer):
    records = [
        record(0.1, [0.02, 0.04, 0.03], 4),
        record(0.3, [0.05], 2),
        record(0.2, [0.01, 0.01], 3),
        failed(),
    ]
    summary, detail = compute_metrics(
        records, tokenizer, duration_s=2.0, percentiles=[50, 90, 99], slos={}, bench_start=100.0
    )
    assert summary["completed"] == 3 and summary["failed"] == 1
    assert summary["total_input_tokens"] == 30  # failed requests' prompts do not count
    assert summary["total_output_tokens"] == 9
    assert summary["request_throughput"] == pytest.approx(1.5)
    assert summary["output_throughput"] == pytest.approx(4.5)
    assert summary["total_token_throughput"] == pytest.approx(19.5)
    assert summary["request_goodput"] is None
    ttfts_ms = np.array([100.0, 300.0, 200.0])
    assert summary["mean_ttft_ms"] == pytest.approx(ttfts_ms.mean())
    assert summary["median_ttft_ms"] == pytest.approx(200.0)
    assert summary["std_ttft_ms"] == pytest.approx(ttfts_ms.std())
    assert summary["p90_ttft_ms"] == pytest.approx(np.percentile(ttfts_ms, 90))
    itls_ms = np.array([20.0, 40.0, 30.0, 50.0, 10.0, 10.0])
    assert summary["mean_itl_ms"] == pytest.approx(itls_ms.mean())
    assert summary["p99_itl_ms"] == pytest.approx(np.percentile(itls_ms, 99))
    # TPOT = (E2EL - TTFT) / (output tokens - 1).
    tpots_ms = [90.0 / 3, 50.0 / 1, 20.0 / 2]
    assert summary["mean_tpot_ms"] == pytest.approx(np.mean(tpots_ms))
    assert (
        summary["p50_e2el_ms"]
        <= summary["p90_e2el_ms"]
        <= summary["p99_e2el_ms"]
        <= summary["max_e2el_ms"]
    )
    assert detail["output_lens"] == [4, 2, 3, 0]
    assert detail["errors"] == ["", "", "", "HTTP 500: boom"]
    assert detail["start_times"] == [0.0, 0.0, 0.0, 0.5]
    assert len(detail["ttfts"]) == len(detail["itls"]) == len(detail["e2els"]) == 4


def test_output_tokens_counted_from_text_without_usage(tokenizer):
    text = " one two three four five"
    summary, detail = compute_metrics(
        [record(0.1, [0.01] * 4, None, text=text)], tokenizer, 1.0, [99], {}, 100.0
    )
    assert detail["output_lens"] == [len(tokenizer.encode(text, add_special_tokens=False))]
    assert summary["total_output_tokens"] == detail["output_lens"][0]


def test_goodput_counts_requests_meeting_every_slo(tokenizer):
    records = [
        record(0.1, [0.02, 0.02], 3),  # ttft 100, tpot 20, e2el 140
        record(0.4, [0.02, 0.02], 3),  # ttft misses
        record(0.1, [0.10, 0.10], 3),  # tpot misses
        record(0.05, [], 1),  # no TPOT: only ttft and e2el apply
        failed(),
    ]
    slos = {"ttft": 200.0, "tpot": 50.0}
    summary, _ = compute_metrics(records, tokenizer, 2.0, [99], slos, 100.0)
    assert summary["request_goodput"] == pytest.approx(2 / 2.0)
    assert summary["request_goodput"] <= summary["request_throughput"]
    assert meets_slos(100.0, None, 900.0, {"ttft": 100.0, "e2el": 1000.0})
    assert not meets_slos(100.0, 60.0, 900.0, {"tpot": 50.0})


def test_all_failed_reports_zeros(tokenizer):
    summary, _ = compute_metrics(
        [failed(), failed("stream error")], tokenizer, 1.0, [99], {"ttft": 1.0}, 100.0
    )
    assert summary["completed"] == 0 and summary["failed"] == 2
    assert summary["mean_ttft_ms"] == 0.0 and summary["request_goodput"] == 0.0


def test_report_has_vllm_layout(tokenizer):
    summary, _ = compute_metrics(
        [record(0.1, [0.02], 2)], tokenizer, 1.0, [50, 99.9], {"e2el": 500.0}, 100.0
    )
    text = format_report(summary, ["ttft", "itl"], [50, 99.9], max_concurrency=4, request_rate=2.0)
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    for label in (
        "Successful requests:",
        "Failed requests:",
        "Maximum request concurrency:",
        "Request rate configured (RPS):",
        "Benchmark duration (s):",
        "Total input tokens:",
        "Total generated tokens:",
        "Request throughput (req/s):",
        "Request goodput (req/s):",
        "Output token throughput (tok/s):",
        "Total Token throughput (tok/s):",
        "Mean TTFT (ms):",
        "Median TTFT (ms):",
        "P50 TTFT (ms):",
        "P99.9 TTFT (ms):",
        "Mean ITL (ms):",
        "P99.9 ITL (ms):",
    ):
        assert any(line.startswith(label) for line in lines), label
    assert "---------------Time to First Token----------------" in lines
    assert "---------------Inter-token Latency----------------" in lines
    assert not any("TPOT" in line or "E2EL" in line for line in lines)
