"""`kvserve serve --metrics-prefix vllm` as a vLLM user's dashboards, alerts and autoscalers
read it: every series of vLLM 0.32 that kvserve honours (tests/support/vllm_metrics.py) under
vLLM's name with vLLM's labels (those vLLM shows only with a flag this server lacks: with
vLLM's labels where kvserve shows them), nothing under a `vllm:` name that vLLM does not export, and
every query of the generated board docs/grafana/kvserve-vllm.json returns a series.
"""

from __future__ import annotations

import json

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import REPO_ROOT
from tests.support.metrics import metrics_text
from tests.support.models import TINY_KV_CACHE_MEMORY
from tests.support.promql import board_queries, unresolved
from tests.support.server import serving
from tests.support.vllm_metrics import HONOURED, VLLM_METRICS, sample_names

pytestmark = pytest.mark.slow

MODEL = "tiny-vllm-names"
BOARD = REPO_ROOT / "docs" / "grafana" / "kvserve-vllm.json"
LONG_PROMPT = "A prompt long enough to fill a few KV blocks of sixteen tokens each. " * 4


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("logs") / "serve.log")
    args = [tiny_llama_dir, "--kv-cache-memory", str(TINY_KV_CACHE_MEMORY)]
    args += ["--served-model-name", MODEL, "--metrics-prefix", "vllm"]
    with serving(args, log) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        completion = client.completions.create(
            model=MODEL,
            prompt="vLLM's names",
            max_tokens=3,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert completion.choices[0].finish_reason == "length"
        # The same long prompt twice: the second finds its full blocks in the prefix cache.
        for _ in range(2):
            client.completions.create(
                model=MODEL,
                prompt=LONG_PROMPT,
                max_tokens=1,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
        yield url


def scrape(url: str) -> list:
    return [
        sample
        for family in text_string_to_metric_families(metrics_text(url))
        for sample in family.samples
    ]


def test_every_honoured_vllm_series_with_vllms_labels(server):
    samples = scrape(server)
    for metric in HONOURED:
        for name in sample_names(metric):
            served = [s for s in samples if s.name == name]
            assert served or metric.only_with is not None, f"{name} missing"
            extra = {"le"} if name.endswith("_bucket") else set()
            for sample in served:
                assert set(sample.labels) == {*metric.labels, *extra}, (name, sample.labels)
            if served and "model_name" in metric.labels:
                assert {s.labels["model_name"] for s in served} == {MODEL}
            if served and "engine" in metric.labels:
                assert {s.labels["engine"] for s in served} == {"0"}
    # The three requests went through under vLLM's names.
    (length,) = [
        s
        for s in samples
        if s.name == "vllm:request_success_total" and s.labels["finished_reason"] == "length"
    ]
    assert length.value == 3

    def value(name: str) -> float:
        (sample,) = [s for s in samples if s.name == name]
        return sample.value

    assert value("vllm:generation_tokens_total") == 3 + 1 + 1
    # Every request has ended: the prefill computed what no cache served.
    cached = value("vllm:prompt_tokens_cached_total")
    assert cached >= 16 and cached == value("vllm:prefix_cache_hits_total")
    assert value("vllm:request_prefill_kv_computed_tokens_sum") == (
        value("vllm:prompt_tokens_total") - cached
    )
    assert value("vllm:request_num_preemptions_count") == 3
    assert value("vllm:request_num_preemptions_sum") == 0


def test_no_vllm_name_that_vllm_does_not_export_and_no_series_twice(server):
    samples = scrape(server)
    vllm_samples = {name for metric in VLLM_METRICS for name in sample_names(metric)}
    served = {s.name for s in samples if s.name.startswith("vllm:")}
    # `_created` aside (prometheus_client's, as in vLLM's own exposition).
    assert {n for n in served if not n.endswith("_created")} <= vllm_samples
    unhonoured = {name for m in VLLM_METRICS if m.unhonoured for name in sample_names(m)}
    assert not served & unhonoured
    # A renamed series is not served under its kvserve: name as well.
    kvserve_names = {s.name for s in samples if s.name.startswith("kvserve:")}
    assert not {"vllm:" + n.removeprefix("kvserve:") for n in kvserve_names} & served
    assert "kvserve:engine_up" in kvserve_names  # kvserve's own keep their name


def test_every_query_of_the_vllm_board_resolves(server):
    samples = scrape(server)
    queries = board_queries(json.loads(BOARD.read_text()))
    assert len(queries) > 30
    problems = {
        query: missing
        for query in queries
        if (missing := unresolved(query, samples, {"model_name": MODEL, "instance": ".*"}))
    }
    assert problems == {}
