"""/metrics of a real `kvserve serve` as a vLLM user's Grafana board reads it.

A tiny model behind real processes (api and engine core, so two clocks), the official openai
client, and the dashboard shipped in docs/grafana/kvserve.json: every series it queries
exists, with vLLM's labels, and the timings and counts agree with what was sent.
"""

from __future__ import annotations

import json
import re

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import REPO_ROOT
from tests.support.metrics import metrics_text
from tests.support.models import TINY_KV_CACHE_MEMORY, TINY_VOCAB_SIZE
from tests.support.promql import board_queries, unresolved
from tests.support.server import read_log, serving
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

MODEL = "tiny-metrics"
DASHBOARD = REPO_ROOT / "docs" / "grafana" / "kvserve.json"
# A metric name right before its label selector, as in `rate(kvserve:x_bucket{...}[5m])`.
_SELECTED_NAME = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\{")
_HISTOGRAM_SUFFIX = re.compile(r"_(bucket|sum|count)$")


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("logs") / "serve.log")
    args = [
        tiny_llama_dir,
        "--kv-cache-memory",
        str(TINY_KV_CACHE_MEMORY),
        "--served-model-name",
        MODEL,
    ]
    with serving(args, log) as url:
        yield url, log


def samples(url: str) -> list:
    text = metrics_text(url)
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def total(snapshot: list, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (over engines)."""
    return sum(
        s.value
        for s in snapshot
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def dashboard_metric_names() -> set[str]:
    """Every metric the dashboard's panels and variables query, histograms by base name."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    exprs += [
        variable["query"]["query"]
        for variable in dashboard["templating"]["list"]
        if variable["type"] == "query"
    ]
    assert len(exprs) > 30
    return {
        _HISTOGRAM_SUFFIX.sub("", name) for expr in exprs for name in _SELECTED_NAME.findall(expr)
    }


def test_metrics_of_a_few_requests(server):
    url, log = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    start = samples(url)

    def delta(before: list, after: list, name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    # One request alone: its engine phases nest inside what the api measured.
    length = client.completions.create(
        model=MODEL,
        prompt="Metrics, one request",
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert length.choices[0].finish_reason == "length"
    one = samples(url)

    def phase(name: str) -> float:
        assert delta(start, one, f"kvserve:{name}_count") == 1, name
        return delta(start, one, f"kvserve:{name}_sum")

    queue, prefill = phase("request_queue_time_seconds"), phase("request_prefill_time_seconds")
    decode, inference = (
        phase("request_decode_time_seconds"),
        phase("request_inference_time_seconds"),
    )
    ttft, e2e = phase("time_to_first_token_seconds"), phase("e2e_request_latency_seconds")
    assert 0 < queue < ttft
    assert queue + prefill < ttft  # engine: received -> first token; api: arrival -> output
    assert queue + inference < e2e
    assert decode > 0 and inference == pytest.approx(prefill + decode, rel=1e-6)

    # Every token a stop token: it stops at the first.
    stop = client.completions.create(
        model=MODEL,
        prompt="Metrics, a stop",
        max_tokens=5,
        temperature=0,
        extra_body={"stop_token_ids": list(range(TINY_VOCAB_SIZE))},
    )
    assert stop.choices[0].finish_reason == "stop" and stop.usage.completion_tokens == 1
    # Two completions of one prompt: two engine requests, stepped together.
    pair = client.completions.create(
        model=MODEL,
        prompt="Metrics, n = 2",
        max_tokens=3,
        n=2,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.finish_reason for c in pair.choices] == ["length", "length"]
    end = samples(url)

    def run_delta(name: str, **labels: str) -> float:
        return delta(start, end, name, **labels)

    assert run_delta("kvserve:request_success_total", finished_reason="length") == 3
    assert run_delta("kvserve:request_success_total", finished_reason="stop") == 1
    assert run_delta("kvserve:request_success_total") == 4
    assert run_delta("kvserve:request_params_n_count") == 3
    assert run_delta("kvserve:request_params_n_sum") == 1 + 1 + 2
    assert run_delta("kvserve:request_max_num_generation_tokens_sum") == 5 + 1 + 3
    assert run_delta("kvserve:request_generation_tokens_sum") == 5 + 1 + 2 * 3
    num_generated = run_delta("kvserve:generation_tokens_total")
    assert num_generated == 5 + 1 + 2 * 3
    # One iteration per engine step that computed tokens: 5 for the first request, 1 for the
    # stop, 3 to 6 for the pair: the api sends its two requests one after the other, and on a
    # busy machine the engine may step the first alone before the second arrives. Each step
    # computed the prompts' uncached tokens and one token per request after its first.
    assert 5 + 1 + 3 <= run_delta("kvserve:iteration_tokens_total_count") <= 5 + 1 + 6
    num_prompt_computed = run_delta("kvserve:prompt_tokens_total") - run_delta(
        "kvserve:prefix_cache_hits_total"
    )
    assert (
        run_delta("kvserve:iteration_tokens_total_sum") == num_prompt_computed + num_generated - 4
    )
    assert (
        run_delta("kvserve:prompt_tokens_total")
        == length.usage.prompt_tokens + stop.usage.prompt_tokens + 2 * pair.usage.prompt_tokens
    )

    # vLLM's labels on every series, engine "0" without data parallelism; the per-tenant
    # series are the api's, across engines, labelled by tenant alone.
    ours = [
        s for s in end if s.name.startswith("kvserve:") and not s.name.startswith("kvserve:tenant_")
    ]
    assert {s.labels.get("engine") for s in ours} == {"0"}
    tenant_series = [s for s in end if s.name.startswith("kvserve:tenant_")]
    assert tenant_series and all(
        s.labels.get("tenant") == "default" and "engine" not in s.labels for s in tenant_series
    )
    info_series = ("kvserve:cache_config_info", "kvserve:gemm_path_info")
    assert {s.labels.get("model_name") for s in ours if s.name not in info_series} == {MODEL}
    (info,) = [s for s in end if s.name == "kvserve:cache_config_info"]
    assert info.labels["block_size"] == "16" and int(info.labels["num_gpu_blocks"]) > 1
    # The CPU GEMM path the engine measured, per linear layer shape (4 linears + LM head).
    gemm = {s.labels["shape"]: s.labels["path"] for s in end if s.name == "kvserve:gemm_path_info"}
    assert len(gemm) >= 5 and all(shape.startswith("float32:") for shape in gemm)
    assert all(path.split(" ")[0] in ("torch", "onednn") for path in gemm.values())

    # Every series the Grafana board queries is there.
    names = {s.name for s in end} | {
        family.name for family in text_string_to_metric_families(metrics_text(url))
    }
    wanted = dashboard_metric_names()
    assert {"kvserve:request_queue_time_seconds", "process_resident_memory_bytes"} <= wanted
    assert wanted - names == set()

    # The periodic stats line comes 10 s after the first step.
    assert wait_until(lambda: "Avg prompt throughput" in read_log(log), timeout_s=30), read_log(log)
    line = next(line for line in read_log(log).splitlines() if "Avg prompt throughput" in line)
    assert "Engine 000: " in line and "Running: " in line and "Prefix cache hit rate: " in line


def test_every_query_of_the_board_resolves(server):
    # The default --metrics-prefix kvserve; tests/e2e/test_metrics_vllm_names.py checks the
    # generated vLLM-named board against a --metrics-prefix vllm server.
    url, _ = server
    queries = board_queries(json.loads(DASHBOARD.read_text()))
    problems = {
        query: missing
        for query in queries
        if (missing := unresolved(query, samples(url), {"model_name": MODEL, "instance": ".*"}))
    }
    assert problems == {}
