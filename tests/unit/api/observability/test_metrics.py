"""The api's metrics from hand-built engine steps: vLLM V1's timings, series and labels, and
the periodic stats line."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.services.api.engine_client.client import EngineClient
from kvserve.services.api.observability.log_stats import LoggingStatLogger
from kvserve.services.api.observability.metrics import ApiMetrics, build_1_2_5_buckets
from kvserve.services.api.observability.stats import IterationStats, PhaseTimes, RequestTimes
from kvserve.services.api.serving.output_processor import OutputProcessor
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

QUEUED, SCHEDULED, PREEMPTED = (
    EngineCoreEventType.QUEUED,
    EngineCoreEventType.SCHEDULED,
    EngineCoreEventType.PREEMPTED,
)
# The engine's clock runs far from the api's: only differences within one clock may be taken.
T0 = 5000.0


def event(kind: EngineCoreEventType, timestamp: float) -> EngineCoreEvent:
    return EngineCoreEvent(kind, timestamp)


# --------------------------------------------------------------------------- timings


def test_timings_of_a_preempted_request_follow_vllm_v1():
    times = RequestTimes(arrival_time=10.0)
    first = IterationStats(now=10.5, engine_timestamp=T0 + 0.3)
    first.observe_output(
        times,
        EngineCoreOutput("r", [5], events=[event(QUEUED, T0), event(SCHEDULED, T0 + 0.1)]),
        num_prompt_tokens=7,
    )
    assert first.time_to_first_tokens == [pytest.approx(0.5)]  # the api's clock
    assert (first.num_prompt_tokens, first.num_generation_tokens) == (7, 1)
    assert first.inter_token_latencies == []

    second = IterationStats(now=10.7, engine_timestamp=T0 + 0.5)
    second.observe_output(times, EngineCoreOutput("r", [6, 7]), num_prompt_tokens=7)
    # One interval per output, however many tokens it holds; no prompt counted again.
    assert second.inter_token_latencies == [pytest.approx(0.2)]
    assert (second.num_prompt_tokens, second.num_generation_tokens) == (0, 2)

    # Preempted, then scheduled again: the queue time ends at the first schedule.
    last = IterationStats(now=11.0, engine_timestamp=T0 + 1.0)
    last.observe_output(
        times,
        EngineCoreOutput(
            "r",
            [8],
            finish_reason=FinishReason.LENGTH,
            events=[event(PREEMPTED, T0 + 0.6), event(SCHEDULED, T0 + 0.8)],
        ),
        num_prompt_tokens=7,
    )
    last.observe_finished(times, "length", num_prompt_tokens=7, max_tokens_param=4)
    (finished,) = last.finished_requests
    assert finished.finish_reason == "length"
    assert finished.e2e_latency == pytest.approx(1.0)
    assert (finished.num_prompt_tokens, finished.num_generation_tokens) == (7, 4)
    assert finished.max_tokens_param == 4
    assert finished.phases == PhaseTimes(
        queued_time=pytest.approx(0.1),
        prefill_time=pytest.approx(0.2),
        decode_time=pytest.approx(0.7),
        inference_time=pytest.approx(0.9),
    )
    assert finished.mean_time_per_output_token == pytest.approx(0.7 / 3)


def test_a_request_without_tokens_has_no_phase_times():
    times = RequestTimes(arrival_time=1.0)
    iteration = IterationStats(now=1.25, engine_timestamp=T0)
    rejected = EngineCoreOutput("r", [], finish_reason=FinishReason.ERROR, error="bad")
    iteration.observe_output(times, rejected, num_prompt_tokens=3)
    iteration.observe_finished(times, "error", num_prompt_tokens=3, max_tokens_param=None)
    (finished,) = iteration.finished_requests
    assert finished.e2e_latency == pytest.approx(0.25)
    assert finished.phases is None and finished.mean_time_per_output_token is None
    assert iteration.time_to_first_tokens == [] and iteration.num_prompt_tokens == 0


def test_a_pooling_requests_prompt_counts_when_its_embedding_comes():
    # Embeddings and scores have no tokens out: their prompts are the whole throughput
    # (the stats line read "Avg prompt throughput: 0.0" while it embedded 1,100 tokens/s).
    times = RequestTimes(arrival_time=2.0)
    iteration = IterationStats(now=2.5, engine_timestamp=T0 + 0.4)
    pooled = EngineCoreOutput(
        "r", [], finish_reason=FinishReason.STOP, pooled=b"\0" * 16, num_cached_tokens=4
    )
    iteration.observe_output(times, pooled, num_prompt_tokens=115)
    assert iteration.num_prompt_tokens == 115 and iteration.num_cached_prompt_tokens == 4
    assert iteration.time_to_first_tokens == [pytest.approx(0.5)]
    assert iteration.num_generation_tokens == 0


def test_one_token_has_no_time_per_output_token():
    times = RequestTimes(arrival_time=0.0)
    iteration = IterationStats(now=0.1, engine_timestamp=T0 + 0.05)
    iteration.observe_output(
        times,
        EngineCoreOutput("r", [1], events=[event(QUEUED, T0), event(SCHEDULED, T0 + 0.01)]),
        num_prompt_tokens=2,
    )
    iteration.observe_finished(times, "stop", num_prompt_tokens=2, max_tokens_param=None)
    (finished,) = iteration.finished_requests
    assert finished.phases.decode_time == 0.0
    assert finished.phases.inference_time == pytest.approx(finished.phases.prefill_time)
    assert finished.mean_time_per_output_token is None


def test_output_processor_times_every_child_and_the_parent():
    processor = OutputProcessor(tokenizer=None)
    child_ids = processor.add_request("r", None, [1, 2, 3], SamplingParams(n=2, max_tokens=3))
    assert child_ids == ["0_r", "1_r"]
    queued = [event(QUEUED, T0), event(SCHEDULED, T0 + 0.1)]
    first = IterationStats(now=time.monotonic(), engine_timestamp=T0 + 0.2)
    processor.process_outputs(
        [EngineCoreOutput(child_id, [4], events=queued) for child_id in child_ids], first
    )
    assert first.num_prompt_tokens == 6 and len(first.time_to_first_tokens) == 2

    last = IterationStats(now=time.monotonic(), engine_timestamp=T0 + 0.4)
    results, _ = processor.process_outputs(
        [
            EngineCoreOutput("0_r", [5, 6], finish_reason=FinishReason.LENGTH),
            EngineCoreOutput("1_r", [9], finish_reason=FinishReason.STOP, stop_reason=9),
        ],
        last,
    )
    assert results[0].finished
    assert [f.finish_reason for f in last.finished_requests] == ["length", "stop"]
    assert [f.num_generation_tokens for f in last.finished_requests] == [3, 2]
    assert [f.phases.decode_time for f in last.finished_requests] == [pytest.approx(0.2)] * 2
    # The api request, once all its children are done: its n and its longest child.
    assert (last.n_params, last.max_num_generation_tokens) == ([2], [3])


# --------------------------------------------------------------------------- the series


class _ClientWithHandshake(EngineClient):
    def engine_handshakes(self) -> list[EngineReady]:
        info = {"block_size": "16", "enable_prefix_caching": "True", "num_gpu_blocks": "99"}
        return [
            EngineReady(
                engine_index=0,
                num_blocks=99,
                max_model_len=512,
                block_size=16,
                hostname="h",
                pid=1,
                cache_config_info=info,
            )
        ]


def samples_of(metrics: ApiMetrics) -> list:
    text = metrics.render()[0].decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def value(samples: list, name: str, **labels: str) -> float:
    (match,) = [
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return match


def run_one_request(client: EngineClient) -> None:
    """One request through the client as three engine steps would deliver it: the prompt
    (3 tokens) and the first token, a second token that ends it, then a step of 0 tokens."""
    client.output_processor.add_request("r", None, [1, 2, 3], SamplingParams(max_tokens=2))
    steps = [
        EngineCoreOutputs(
            [EngineCoreOutput("r", [5], events=[event(QUEUED, T0), event(SCHEDULED, T0 + 0.25)])],
            SchedulerStats(num_running_reqs=1, num_scheduled_tokens=3, prefix_cache_queries=3),
            timestamp=T0 + 0.75,
        ),
        EngineCoreOutputs(
            [EngineCoreOutput("r", [6], finish_reason=FinishReason.LENGTH)],
            SchedulerStats(num_running_reqs=1, num_scheduled_tokens=1),
            timestamp=T0 + 1.0,
        ),
        # The step that tells the workers the request is gone schedules nothing.
        EngineCoreOutputs([], SchedulerStats(), timestamp=T0 + 1.01),
    ]

    async def deliver():
        for outputs in steps:
            await client._handle_outputs(outputs)

    asyncio.run(deliver())


def test_series_of_one_request_carry_vllm_names_and_labels():
    client = _ClientWithHandshake(
        SimpleNamespace(tokenizer=None), max_model_len=512, model_name="m"
    )
    metrics = ApiMetrics(client, "m")
    run_one_request(client)
    samples = samples_of(metrics)

    # The per-tenant series sum over engines and models, as kvserve:api_key_requests does.
    ours = [
        s
        for s in samples
        if s.name.startswith("kvserve:") and not s.name.startswith("kvserve:tenant_")
    ]
    assert ours and all(s.labels["engine"] == "0" for s in ours)
    assert all(s.labels["model_name"] == "m" for s in ours if s.name != "kvserve:cache_config_info")
    assert value(samples, "kvserve:request_queue_time_seconds_sum") == pytest.approx(0.25)
    assert value(samples, "kvserve:request_prefill_time_seconds_sum") == pytest.approx(0.5)
    assert value(samples, "kvserve:request_decode_time_seconds_sum") == pytest.approx(0.25)
    assert value(samples, "kvserve:request_inference_time_seconds_sum") == pytest.approx(0.75)
    assert value(samples, "kvserve:request_time_per_output_token_seconds_sum") == pytest.approx(
        0.25
    )
    for name in ("inter_token_latency_seconds", "time_per_output_token_seconds"):
        assert value(samples, f"kvserve:{name}_count") == 1
        assert value(samples, f"kvserve:{name}_sum") == pytest.approx(0.25)
    assert value(samples, "kvserve:request_success_total", finished_reason="length") == 1
    assert value(samples, "kvserve:request_success_total", finished_reason="stop") == 0
    # Two steps computed tokens (3, then 1); the empty one is no iteration.
    assert value(samples, "kvserve:iteration_tokens_total_count") == 2
    assert value(samples, "kvserve:iteration_tokens_total_sum") == 4
    assert value(samples, "kvserve:prompt_tokens_total") == 3
    assert value(samples, "kvserve:generation_tokens_total") == 2
    assert value(samples, "kvserve:time_to_first_token_seconds_count") == 1
    assert value(samples, "kvserve:e2e_request_latency_seconds_count") == 1
    assert value(samples, "kvserve:request_prompt_tokens_sum") == 3
    assert value(samples, "kvserve:request_generation_tokens_sum") == 2
    assert value(samples, "kvserve:request_params_max_tokens_sum") == 2
    assert value(samples, "kvserve:request_params_n_sum") == 1
    assert value(samples, "kvserve:request_max_num_generation_tokens_sum") == 2
    assert value(samples, "kvserve:prefix_cache_queries_total") == 3
    assert value(samples, "kvserve:num_requests_running") == 0  # the latest step's
    assert value(samples, "kvserve:engine_up") == 1
    assert (
        value(
            samples,
            "kvserve:cache_config_info",
            block_size="16",
            enable_prefix_caching="True",
            num_gpu_blocks="99",
        )
        == 1
    )
    names = {s.name for s in samples}
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes"} <= names


def test_series_exist_before_any_request():
    client = EngineClient(SimpleNamespace(tokenizer=None), max_model_len=100, model_name="m")
    samples = samples_of(ApiMetrics(client, "m"))
    assert value(samples, "kvserve:request_queue_time_seconds_count", engine="0") == 0
    assert value(samples, "kvserve:request_success_total", finished_reason="abort") == 0
    assert value(samples, "kvserve:iteration_tokens_total_count") == 0
    # Token-count buckets stop at max_model_len, as vLLM's do.
    buckets = [s.labels["le"] for s in samples if s.name == "kvserve:request_prompt_tokens_bucket"]
    assert buckets == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "+Inf"]


def test_1_2_5_buckets():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(4) == [1, 2]


# --------------------------------------------------------------------------- the log line


def iteration(num_prompt_tokens: int = 0, num_generation_tokens: int = 0) -> IterationStats:
    stats = IterationStats(now=0.0, engine_timestamp=0.0)
    stats.num_prompt_tokens, stats.num_generation_tokens = num_prompt_tokens, num_generation_tokens
    return stats


def test_log_line_of_an_active_interval_and_none_while_idle():
    stat_logger = LoggingStatLogger()
    stat_logger.record(
        0,
        SchedulerStats(
            num_running_reqs=2,
            num_waiting_reqs=1,
            kv_cache_usage=0.5,
            prefix_cache_queries=80,
            prefix_cache_hits=20,
        ),
        iteration(100, 5),
    )
    stat_logger.record(
        0,
        SchedulerStats(
            num_running_reqs=2,
            num_waiting_reqs=1,
            kv_cache_usage=0.5,
            prefix_cache_queries=20,
            prefix_cache_hits=5,
        ),
        iteration(0, 15),
    )
    start = stat_logger.interval_start
    assert stat_logger.log(now=start + 10.0) == [
        "Engine 000: Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 2.0 "
        "tokens/s, Running: 2 reqs, Waiting: 1 reqs, GPU KV cache usage: 50.0%, Prefix cache "
        "hit rate: 25.0%"
    ]
    # Requests still held, no tokens: a line (a stuck engine shows), the hit rate kept.
    assert stat_logger.log(now=start + 20.0) == [
        "Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 "
        "tokens/s, Running: 2 reqs, Waiting: 1 reqs, GPU KV cache usage: 50.0%, Prefix cache "
        "hit rate: 25.0%"
    ]
    stat_logger.record(0, SchedulerStats(), iteration())
    assert stat_logger.log(now=start + 30.0) == []


def test_log_lines_per_engine_only_for_the_active_ones():
    stat_logger = LoggingStatLogger()
    stat_logger.record(1, SchedulerStats(num_running_reqs=1), iteration(0, 4))
    stat_logger.record(0, SchedulerStats(), iteration())
    (line,) = stat_logger.log(now=stat_logger.interval_start + 2.0)
    assert line.startswith(
        "Engine 001: Avg prompt throughput: 0.0 tokens/s, Avg generation "
        "throughput: 2.0 tokens/s, Running: 1 reqs"
    )


def test_log_timer_runs_while_active_and_stops_when_idle():
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("kvserve.services.api.observability.log_stats").addHandler(handler)
    stat_logger = LoggingStatLogger(interval_s=0.05)

    async def run():
        stat_logger.record(0, SchedulerStats(num_running_reqs=1), iteration(3, 1))
        deadline = time.monotonic() + 10
        while len(lines) < 2 and time.monotonic() < deadline:  # busy: a line per interval
            await asyncio.sleep(0.01)
        stat_logger.record(0, SchedulerStats(), iteration())  # the last request is done
        await asyncio.sleep(0.01)
        num_lines = len(lines)
        await asyncio.sleep(0.3)  # idle: six intervals pass in silence
        return num_lines

    try:
        num_lines = asyncio.run(run())
    finally:
        logging.getLogger("kvserve.services.api.observability.log_stats").removeHandler(handler)
    assert num_lines >= 2 and len(lines) <= num_lines + 1, lines
    assert all(line.startswith("Engine 000: Avg prompt throughput") for line in lines)
    assert stat_logger._timer is None
