"""The scheduler's timed request events (queued, scheduled, preempted) and per-step token
count, which the api turns into vLLM's queue, prefill, decode and inference times."""

from __future__ import annotations

import msgspec

from kvserve.services.scheduler.engine.engine_core import cache_config_info
from kvserve.shared.config import CacheConfig
from kvserve.shared.messages import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
)
from tests.support.kv import assert_no_leaked_blocks
from tests.support.scheduler import create_request, create_scheduler, run_to_completion, step

QUEUED, SCHEDULED, PREEMPTED = (
    EngineCoreEventType.QUEUED,
    EngineCoreEventType.SCHEDULED,
    EngineCoreEventType.PREEMPTED,
)


def kinds(output: EngineCoreOutput) -> list[EngineCoreEventType] | None:
    return None if output.events is None else [e.type for e in output.events]


def test_queued_and_scheduled_come_with_the_first_output_only():
    scheduler = create_scheduler()
    scheduler.add_request(create_request("a", num_tokens=10, max_tokens=3))
    _, (first,) = step(scheduler)
    assert kinds(first) == [QUEUED, SCHEDULED]
    queued, scheduled = first.events
    assert 0 < queued.timestamp <= scheduled.timestamp
    _, (second,) = step(scheduler)
    assert second.events is None  # nothing happened: the step carries no event
    run_to_completion(scheduler)
    assert_no_leaked_blocks(scheduler)


def test_events_of_a_chunked_prompt_wait_for_its_first_output():
    scheduler = create_scheduler(max_num_batched_tokens=16)
    scheduler.add_request(create_request("a", num_tokens=40, max_tokens=2))
    scheduled_at = []
    for _ in range(2):  # two chunks of 16 tokens: no output, so no event sent yet
        assert step(scheduler)[1] == []
        scheduled_at.append(scheduler.requests["a"].events[-1].timestamp)
    _, (first,) = step(scheduler)
    # Scheduled from the waiting queue once: later chunks are running-request steps.
    assert kinds(first) == [QUEUED, SCHEDULED] and first.new_token_ids
    assert scheduled_at[0] == scheduled_at[1] == first.events[1].timestamp
    run_to_completion(scheduler)
    assert_no_leaked_blocks(scheduler)


def test_a_preempted_request_reports_preemption_and_its_new_schedule():
    # Two blocks of 16 tokens for both: "b" is preempted when "a" needs a block more.
    scheduler = create_scheduler(block_size=16, num_blocks=4)
    scheduler.add_request(create_request("a", num_tokens=16, max_tokens=20))
    scheduler.add_request(create_request("b", num_tokens=15, max_tokens=20))
    _, outputs = step(scheduler)
    assert [kinds(out) for out in outputs] == [[QUEUED, SCHEDULED]] * 2
    events: dict[str, list[EngineCoreEvent]] = {"a": [], "b": []}
    for _ in range(60):
        if not scheduler.has_requests():
            break
        for out in step(scheduler)[1]:
            events[out.request_id] += out.events or []
    assert [e.type for e in events["a"]] == []
    assert [e.type for e in events["b"]] == [PREEMPTED, SCHEDULED]
    preempted, rescheduled = events["b"]
    assert preempted.timestamp < rescheduled.timestamp
    assert scheduler.num_preemptions_total == 1
    assert_no_leaked_blocks(scheduler)


def test_no_events_without_log_stats():
    scheduler = create_scheduler(log_stats=False)
    scheduler.add_request(create_request("a", num_tokens=10, max_tokens=2))
    finals = run_to_completion(scheduler)
    assert finals["a"].events is None
    assert_no_leaked_blocks(scheduler)


def test_stats_count_the_tokens_each_step_scheduled():
    scheduler = create_scheduler()
    scheduler.add_request(create_request("a", num_tokens=30, max_tokens=2))
    scheduler.add_request(create_request("b", num_tokens=12, max_tokens=2))
    step(scheduler)
    assert scheduler.make_stats().num_scheduled_tokens == 42
    step(scheduler)
    assert scheduler.make_stats().num_scheduled_tokens == 2  # one decode token each
    step(scheduler)  # delivers the finished ids to the workers: nothing computed
    assert scheduler.make_stats().num_scheduled_tokens == 0
    assert_no_leaked_blocks(scheduler)


def test_events_travel_only_on_the_outputs_that_have_them():
    encoder = msgspec.msgpack.Encoder()
    plain = EngineCoreOutput("r", [1])
    with_events = EngineCoreOutput("r", [1], events=[EngineCoreEvent(SCHEDULED, 12.5)])
    # array_like encodes every field in order: on a step without events the field costs
    # one nil byte.
    assert msgspec.msgpack.decode(encoder.encode(plain))[-1] is None
    assert (
        len(encoder.encode(with_events)) - len(encoder.encode(plain))
        == len(encoder.encode([EngineCoreEvent(SCHEDULED, 12.5)])) - 1
    )
    decoded = msgspec.msgpack.decode(
        encoder.encode(EngineCoreOutputs([with_events, plain], timestamp=3.0)),
        type=EngineCoreOutputs,
    )
    assert decoded.outputs == [with_events, plain]
    assert decoded.outputs[0].events[0].type is SCHEDULED


def test_cache_config_info_holds_every_field_and_the_block_count():
    info = cache_config_info(CacheConfig(block_size=32, kv_cache_memory_bytes=1 << 30), 777)
    assert info["block_size"] == "32" and info["num_gpu_blocks"] == "777"
    assert info["enable_prefix_caching"] == "True"
    assert info["kv_cache_memory_bytes"] == str(1 << 30)
    assert info["gpu_memory_utilization"] == "0.9"
    assert set(msgspec.structs.asdict(CacheConfig())) <= set(info)
