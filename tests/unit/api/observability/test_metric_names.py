"""--metrics-prefix vllm: the api's series under vLLM 0.32's names and labels, from the one
table in services/api/observability/metric_names.py; the Grafana board made from it; the PromQL
reader the e2e tests check boards with."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from types import SimpleNamespace

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvserve.services.api.engine_client.client import EngineClient
from kvserve.services.api.observability.metric_names import VLLM_NAMES, exposed_name
from kvserve.services.api.observability.metrics import ApiMetrics
from kvserve.shared.api_config import FrontendConfig
from kvserve.shared.messages import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    SchedulerStats,
)
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.wire import EngineReady
from tests.support import REPO_ROOT
from tests.support.promql import board_queries, selectors, unresolved
from tests.support.vllm_metrics import (
    CACHE_CONFIG_FIELDS,
    HONOURED,
    VLLM_METRICS,
    VLLM_SCRAPE,
)

BOARDS = REPO_ROOT / "docs" / "grafana"


class _Client(EngineClient):
    """A real EngineClient that has heard one engine's READY (its cache config)."""

    def engine_handshakes(self) -> list[EngineReady]:
        info = {"block_size": "16", "enable_prefix_caching": "True", "num_gpu_blocks": "99"}
        ready = EngineReady(
            engine_index=0,
            num_blocks=99,
            max_model_len=512,
            block_size=16,
            hostname="h",
            pid=1,
            cache_config_info=info,
        )
        return [ready]


def scrape(metrics_prefix: str, max_loras: int | None = None, steps=()) -> list:
    """/metrics after `steps` (EngineCoreOutputs of request "r", 5 prompt tokens)."""
    client = _Client(SimpleNamespace(tokenizer=None), max_model_len=512, model_name="m")
    metrics = ApiMetrics(client, "m", max_loras, metrics_prefix)
    if steps:
        client.output_processor.add_request("r", None, [1, 2, 3, 4, 5], SamplingParams())

        async def deliver():
            for outputs in steps:
                await client._handle_outputs(outputs)

        asyncio.run(deliver())
    text = metrics.render()[0].decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def value(samples: list, name: str) -> float:
    (match,) = [s.value for s in samples if s.name == name]
    return match


def test_the_vllm_list_is_what_vllm_032_serves():
    # A live vLLM 0.32 server's /metrics (default flags): every family in the list with the
    # same type and labels; the list's others need a flag.
    served = {
        family.name: family
        for family in text_string_to_metric_families(VLLM_SCRAPE.read_text())
        if not family.name.endswith("_created")
    }
    listed = {metric.name: metric for metric in VLLM_METRICS}
    assert len(served) == 39
    for name, family in served.items():
        metric = listed[name]
        assert family.type == metric.type, name
        labels = {label for s in family.samples for label in s.labels} - {"le"}
        assert labels == set(metric.labels), name
    assert {name for name, m in listed.items() if m.only_with is None} <= served.keys()
    (info,) = served["vllm:cache_config_info"].samples
    assert set(info.labels) == {"engine", *CACHE_CONFIG_FIELDS}


def test_the_table_names_only_series_of_the_vllm_list():
    vllm_families = {metric.name for metric in VLLM_METRICS}
    for kvserve_name, (vllm_name, _) in VLLM_NAMES.items():
        assert vllm_name in vllm_families, kvserve_name
        # Same name after the prefix: a vLLM user finds the series where the docs say.
        assert kvserve_name.removeprefix("kvserve:") == vllm_name.removeprefix("vllm:")
    assert {vllm_name for vllm_name, _ in VLLM_NAMES.values()} == {m.name for m in HONOURED}


def test_vllm_prefix_renames_every_shared_series_and_keeps_kvserve_only_ones():
    kvserve_samples, vllm_samples = scrape("kvserve", max_loras=2), scrape("vllm", max_loras=2)
    # The same samples, values and label values, only the names (and one label set) differ.
    assert len(kvserve_samples) == len(vllm_samples)
    renamed = {
        (exposed_name(s.name, "vllm"), tuple(sorted(s.labels.items())))
        for s in kvserve_samples
        if not s.name.endswith("cache_config_info") and not s.name.startswith("python_gc")
    }
    served = {
        (s.name, tuple(sorted(s.labels.items())))
        for s in vllm_samples
        if not s.name.endswith("cache_config_info") and not s.name.startswith("python_gc")
    }
    assert renamed == served
    names = {s.name for s in vllm_samples}
    assert "vllm:num_requests_waiting" in names and "kvserve:num_requests_waiting" not in names
    assert "vllm:request_success_total" in names and "vllm:lora_requests_info" in names
    # kvserve's own series keep their names: vLLM has no such series.
    assert {"kvserve:engine_up", "kvserve:request_migrations_total"} <= names
    assert "kvserve:time_per_output_token_seconds_count" in names  # gone from vLLM 0.32
    vllm_families = {metric.name for metric in VLLM_METRICS}
    for name in names:
        if name.startswith("vllm:"):
            family = exposed_name(name, "vllm")
            assert any(name.startswith(f) for f in vllm_families), family


def test_cache_config_info_carries_vllm_032s_label_set():
    (info,) = [s for s in scrape("vllm") if s.name == "vllm:cache_config_info"]
    assert set(info.labels) == {"engine", *CACHE_CONFIG_FIELDS}
    # kvserve's values where it has the field; "None" (vLLM's unset) where it has not.
    assert info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == "99"
    assert info.labels["mamba_cache_mode"] == "None" and info.labels["engine"] == "0"
    assert info.value == 1


def test_preemptions_and_cached_tokens_of_a_request():
    # Queued, scheduled with 3 of its 5 prompt tokens cached, preempted, scheduled again,
    # its first token, then its last.
    T0 = 100.0
    queued, scheduled, preempted = (
        EngineCoreEventType.QUEUED,
        EngineCoreEventType.SCHEDULED,
        EngineCoreEventType.PREEMPTED,
    )
    events = [
        EngineCoreEvent(queued, T0),
        EngineCoreEvent(scheduled, T0 + 0.1),
        EngineCoreEvent(preempted, T0 + 0.2),
        EngineCoreEvent(scheduled, T0 + 0.3),
    ]
    steps = [
        EngineCoreOutputs(
            [EngineCoreOutput("r", [7], num_cached_tokens=3, events=events)],
            SchedulerStats(num_scheduled_tokens=2),
            timestamp=T0 + 0.5,
        ),
        EngineCoreOutputs(
            [EngineCoreOutput("r", [8], finish_reason=FinishReason.LENGTH)],
            SchedulerStats(num_scheduled_tokens=1),
            timestamp=T0 + 0.6,
        ),
    ]
    samples = scrape("vllm", steps=steps)
    assert value(samples, "vllm:prompt_tokens_total") == 5
    assert value(samples, "vllm:prompt_tokens_cached_total") == 3
    assert value(samples, "vllm:request_prefill_kv_computed_tokens_sum") == 5 - 3
    assert value(samples, "vllm:request_num_preemptions_sum") == 1
    assert value(samples, "vllm:request_num_preemptions_count") == 1


def test_lora_requests_info_keeps_vllms_labels():
    (info,) = [s for s in scrape("vllm", max_loras=3) if s.name == "vllm:lora_requests_info"]
    assert set(info.labels) == {"max_lora", "waiting_lora_adapters", "running_lora_adapters"}
    assert info.labels["max_lora"] == "3"


def test_the_flag_takes_kvserve_or_vllm_only():
    assert FrontendConfig().metrics_prefix == "kvserve"
    assert msgspec.convert({"metrics_prefix": "vllm"}, FrontendConfig).metrics_prefix == "vllm"
    with pytest.raises(msgspec.ValidationError, match="metrics_prefix"):
        msgspec.convert({"metrics_prefix": "sglang"}, FrontendConfig)


def test_the_checked_in_vllm_board_is_the_generated_one():
    spec = importlib.util.spec_from_file_location("make_vllm_board", BOARDS / "make_vllm_board.py")
    assert spec is not None and spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    board = json.loads((BOARDS / "kvserve.json").read_text())
    expected = generator.board_text(generator.vllm_board(board))
    assert (BOARDS / "kvserve-vllm.json").read_text() == expected, (
        "run: python docs/grafana/make_vllm_board.py"
    )
    queries = board_queries(json.loads(expected))
    assert any("vllm:num_requests_running" in q for q in queries)
    assert all("kvserve:" not in q or "kvserve:engine_up" in q for q in queries)


def test_promql_reader_finds_selectors_groupings_and_missing_series():
    expr = (
        'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$m"}'
        "[$__rate_interval])) / sum(rate(x_count[5m]))"
    )
    found = selectors(expr)
    assert [s.name for s in found] == ["vllm:request_success_total", "x_count"]
    assert found[0].matchers == (("model_name", "=", "$m"),)
    success = Sample(
        "vllm:request_success_total", {"model_name": "a", "finished_reason": "stop"}, 1
    )
    count = Sample("x_count", {"model_name": "a"}, 0)
    assert unresolved(expr, [success, count], {"m": "a"}) == []
    assert unresolved(expr, [success, count], {"m": "b"}) == [
        "vllm:request_success_total{'model_name': 'b'}"
    ]
    assert unresolved(expr, [success], {"m": "a"}) == ["x_count{}"]
    grouped = 'sum by(engine) (vllm:request_success_total{model_name="a"})'
    assert unresolved(grouped, [success], {}) == [
        f"no series of {grouped!r} has the label 'engine'"
    ]
    # A variable's query: its label must be there; target labels are Prometheus's own.
    assert unresolved("label_values(x_count, model_name)", [count], {}) == []
    assert unresolved("label_values(x_count, engine)", [count], {}) != []
    assert unresolved('x_count{instance=~"$i"}', [count], {"i": "h:1"}) == []
