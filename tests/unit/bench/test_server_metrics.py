"""Server-side figures from Prometheus text: kvserve's and vLLM's names, absent metrics."""

from __future__ import annotations

import pytest

from kvserve.benchmarks.server_metrics import format_server_report, parse_engine_metrics, \
    server_delta

# Counters in both exposition forms: TYPE named with and without `_total`.
KVSERVE_TEXT = """\
# HELP kvserve:kv_cache_usage_perc Fraction of KV-cache blocks in use (0..1).
# TYPE kvserve:kv_cache_usage_perc gauge
kvserve:kv_cache_usage_perc{model_name="m"} 0.25
# HELP kvserve:num_preemptions_total Requests preempted by the scheduler.
# TYPE kvserve:num_preemptions_total counter
kvserve:num_preemptions_total{model_name="m"} 3.0
# HELP kvserve:prefix_cache_queries Prompt tokens looked up in the prefix cache.
# TYPE kvserve:prefix_cache_queries counter
kvserve:prefix_cache_queries_total{model_name="m"} 400.0
kvserve:prefix_cache_queries_created{model_name="m"} 1.7e+09
# HELP kvserve:prefix_cache_hits Prompt tokens found in the prefix cache.
# TYPE kvserve:prefix_cache_hits counter
kvserve:prefix_cache_hits_total{model_name="m"} 100.0
"""


def test_parses_kvserve_metrics_without_created_timestamps():
    assert parse_engine_metrics(KVSERVE_TEXT) == {
        "kv_cache_usage_perc": 0.25, "num_preemptions": 3.0,
        "prefix_cache_queries": 400.0, "prefix_cache_hits": 100.0}


def test_parses_vllm_names_and_combines_engines():
    text = KVSERVE_TEXT.replace("kvserve:", "vllm:") + \
        'vllm:prefix_cache_hits_total{model_name="m",engine="1"} 50.0\n' \
        'vllm:kv_cache_usage_perc{model_name="m",engine="1"} 0.75\n'
    values = parse_engine_metrics(text)
    assert values["prefix_cache_hits"] == 150.0
    assert values["kv_cache_usage_perc"] == 0.75


@pytest.mark.parametrize("text", [
    "# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 12\n",
    "", "<html>not found</html>"])
def test_other_servers_have_no_engine_metrics(text):
    assert parse_engine_metrics(text) is None


def test_delta_hit_rate_and_peak():
    before = {"num_preemptions": 3.0, "prefix_cache_queries": 400.0,
              "prefix_cache_hits": 100.0, "kv_cache_usage_perc": 0.0}
    after = {"num_preemptions": 5.0, "prefix_cache_queries": 1400.0,
             "prefix_cache_hits": 850.0, "kv_cache_usage_perc": 0.1}
    figures = server_delta(before, after, peak_kv_usage=0.6)
    assert figures["server_num_preemptions"] == 2
    assert figures["server_prefix_cache_hit_rate"] == pytest.approx(0.75)
    assert figures["server_peak_kv_cache_usage"] == 0.6
    assert "75.00" in format_server_report(figures)
    idle = server_delta(before, before, 0.0)
    assert idle["server_prefix_cache_hit_rate"] is None
    assert "n/a" in format_server_report(idle)
