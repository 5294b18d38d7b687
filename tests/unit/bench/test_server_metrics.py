"""Server-side figures from Prometheus text: kvserve's and vLLM's names, absent metrics."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvserve.benchmarks.server_metrics import (
    format_server_report,
    parse_engine_metrics,
    server_delta,
)
from kvserve.services.api.engine_client.client import EngineClient
from kvserve.services.api.observability.metrics import ApiMetrics
from kvserve.shared.messages import EngineCoreOutputs, SchedulerStats

# Counters in both exposition forms: TYPE named with and without `_total`.
KVSERVE_TEXT = """\
# HELP kvserve:kv_cache_usage_perc Fraction of KV-cache blocks in use (0..1).
# TYPE kvserve:kv_cache_usage_perc gauge
kvserve:kv_cache_usage_perc{model_name="m",engine="0"} 0.25
# HELP kvserve:num_preemptions_total Requests preempted by the scheduler.
# TYPE kvserve:num_preemptions_total counter
kvserve:num_preemptions_total{model_name="m",engine="0"} 3.0
# HELP kvserve:prefix_cache_queries Prompt tokens looked up in the prefix cache.
# TYPE kvserve:prefix_cache_queries counter
kvserve:prefix_cache_queries_total{model_name="m",engine="0"} 400.0
kvserve:prefix_cache_queries_created{model_name="m",engine="0"} 1.7e+09
# HELP kvserve:prefix_cache_hits Prompt tokens found in the prefix cache.
# TYPE kvserve:prefix_cache_hits counter
kvserve:prefix_cache_hits_total{model_name="m",engine="0"} 100.0
"""


def test_parses_kvserve_metrics_without_created_timestamps():
    assert parse_engine_metrics(KVSERVE_TEXT) == {
        "kv_cache_usage_perc": 0.25,
        "num_preemptions": 3.0,
        "prefix_cache_queries": 400.0,
        "prefix_cache_hits": 100.0,
    }


def test_parses_vllm_names_and_combines_engines():
    text = (
        KVSERVE_TEXT.replace("kvserve:", "vllm:")
        + 'vllm:prefix_cache_hits_total{model_name="m",engine="1"} 50.0\n'
        'vllm:kv_cache_usage_perc{model_name="m",engine="1"} 0.75\n'
    )
    values = parse_engine_metrics(text)
    assert values["prefix_cache_hits"] == 150.0
    assert values["kv_cache_usage_perc"] == 0.75


@pytest.mark.parametrize(
    "text",
    [
        "# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 12\n",
        "",
        "<html>not found</html>",
    ],
)
def test_other_servers_have_no_engine_metrics(text):
    assert parse_engine_metrics(text) is None


def test_delta_hit_rate_and_peak():
    before = {
        "num_preemptions": 3.0,
        "prefix_cache_queries": 400.0,
        "prefix_cache_hits": 100.0,
        "kv_cache_usage_perc": 0.0,
    }
    after = {
        "num_preemptions": 5.0,
        "prefix_cache_queries": 1400.0,
        "prefix_cache_hits": 850.0,
        "kv_cache_usage_perc": 0.1,
    }
    figures = server_delta(before, after, peak_kv_usage=0.6)
    assert figures["server_num_preemptions"] == 2
    assert figures["server_prefix_cache_hit_rate"] == pytest.approx(0.75)
    assert figures["server_peak_kv_cache_usage"] == 0.6
    assert "75.00" in format_server_report(figures)
    idle = server_delta(before, before, 0.0)
    assert idle["server_prefix_cache_hit_rate"] is None
    assert "n/a" in format_server_report(idle)


def test_parses_the_api_servers_own_exposition():
    """kvserve's /metrics as the api renders it (every vLLM series, process metrics)."""
    client = EngineClient(SimpleNamespace(tokenizer=None), max_model_len=64, model_name="m")
    metrics = ApiMetrics(client, "m")
    stats = SchedulerStats(
        kv_cache_usage=0.5,
        num_preemptions=2,
        prefix_cache_queries=40,
        prefix_cache_hits=16,
        num_scheduled_tokens=24,
        spec_num_drafts=3,
        spec_num_draft_tokens=9,
        spec_num_accepted_tokens=5,
        spec_accepted_per_pos=[3, 2, 0],
        external_prefix_cache_queries=64,
        external_prefix_cache_hits=32,
    )
    asyncio.run(client._handle_outputs(EngineCoreOutputs(scheduler_stats=stats)))
    values = parse_engine_metrics(metrics.render()[0].decode())
    assert values == {
        "kv_cache_usage_perc": 0.5,
        "num_preemptions": 2.0,
        "prefix_cache_queries": 40.0,
        "prefix_cache_hits": 16.0,
        "spec_decode_num_drafts": 3.0,
        "spec_decode_num_draft_tokens": 9.0,
        "spec_decode_num_accepted_tokens": 5.0,
        "external_prefix_cache_queries": 64.0,
        "external_prefix_cache_hits": 32.0,
        **{
            f"request_{phase}_time_seconds_{part}": 0.0
            for phase in ("queue", "prefill", "decode")
            for part in ("sum", "count")
        },
    }


def test_phase_means_combine_engines_and_need_finished_requests():
    text = "".join(
        f'vllm:request_{phase}_time_seconds_{part}{{model_name="m",engine="{engine}"}} {value}\n'
        for engine, scale in (("0", 1.0), ("1", 3.0))
        for phase, seconds in (("queue", 0.01), ("prefill", 0.1), ("decode", 1.0))
        for part, value in (("sum", seconds * scale), ("count", 2.0))
    )
    after = parse_engine_metrics(text)
    before = {name: 0.0 for name in after}
    figures = server_delta(before, after, peak_kv_usage=0.0)
    # Engine 0: 2 requests, 0.01 s of queue in all; engine 1: 2 requests, 0.03 s.
    assert figures["server_mean_queue_time_ms"] == pytest.approx(10.0)
    assert figures["server_mean_prefill_time_ms"] == pytest.approx(100.0)
    assert figures["server_mean_decode_time_ms"] == pytest.approx(1000.0)
    report = format_server_report(figures)
    assert "Mean queue time (ms):" in report and "1000.00" in report
    idle = server_delta(after, after, 0.0)
    assert idle["server_mean_queue_time_ms"] is None
    assert "Mean queue time" not in format_server_report(idle)


def test_spec_decode_figures_from_the_counters():
    before = {"spec_decode_num_drafts": 10.0, "spec_decode_num_draft_tokens": 40.0}
    after = {
        "spec_decode_num_drafts": 20.0,
        "spec_decode_num_draft_tokens": 80.0,
        "spec_decode_num_accepted_tokens": 25.0,
    }
    figures = server_delta(before, after, 0.0)
    assert figures["server_spec_acceptance_rate"] == 25 / 40
    assert figures["server_spec_mean_acceptance_length"] == 1 + 25 / 10
    report = format_server_report(figures)
    assert "Draft acceptance rate (%):" in report and "62.50" in report
    idle = server_delta(after, after, 0.0)
    assert idle["server_spec_acceptance_rate"] is None
    assert idle["server_external_prefix_cache_hit_rate"] is None
    assert "acceptance" not in format_server_report(idle)


def test_external_prefix_cache_hit_rate():
    before = {"external_prefix_cache_queries": 100.0, "external_prefix_cache_hits": 10.0}
    after = {"external_prefix_cache_queries": 300.0, "external_prefix_cache_hits": 160.0}
    figures = server_delta(before, after, 0.0)
    assert figures["server_external_prefix_cache_hit_rate"] == 0.75
    assert "External prefix cache hit rate (%):" in format_server_report(figures)
    assert "75.00" in format_server_report(figures)
