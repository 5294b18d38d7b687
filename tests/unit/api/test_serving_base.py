"""Stream deltas with stop-string hold-back, merging of request streams, request metrics."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.shared.messages import EngineCoreOutputs, SchedulerStats
from kvserve.services.api.engine_client import EngineClient
from kvserve.services.api.metrics import ApiMetrics
from kvserve.services.api.outputs import CompletionOutput, RequestOutput
from kvserve.services.api.serving_base import StreamedChoice, merge_async_iterators
from kvserve.services.api.stop_strings import check_stop_strings
from kvserve.services.api.tokenizer import TokenizerInfo


def stream_texts(steps: list[str], stop: list[str], holdback: int) -> tuple[str, str]:
    """Feed cumulative outputs as the OutputProcessor would; (streamed text, final text)."""
    state = StreamedChoice(holdback)
    completion = CompletionOutput(index=0)
    streamed = ""
    for i, piece in enumerate(steps):
        completion.token_ids.append(i)
        completion.text += piece
        hit = check_stop_strings(completion.text, len(piece), stop, False)
        if hit is not None:
            completion.text = completion.text[:hit[1]]
            completion.finish_reason = "stop"
        elif i == len(steps) - 1:
            completion.finish_reason = "length"
        delta = state.next_delta(completion, want_tokens=False)
        if delta is not None:
            streamed += delta[0]
        if completion.finish_reason:
            break
    return streamed, completion.text


@pytest.mark.parametrize("steps, stop", [
    (["Hello", " wor", "ld", " again"], ["world"]),  # stop string across two steps
    (["ab", "c", "de", "f"], ["cd"]),
    (["one", " two", " three"], ["zzz"]),  # never hits: everything comes out at the end
    (["x", "yz"], ["xyz", "y"]),
])
def test_streamed_text_equals_final_text(steps, stop):
    holdback = max(len(s) for s in stop) - 1
    streamed, final = stream_texts(steps, stop, holdback)
    assert streamed == final


def test_without_holdback_a_stop_string_would_leak():
    streamed, final = stream_texts(["Hello", " wor", "ld"], ["world"], holdback=0)
    assert final == "Hello " and streamed == "Hello wor"  # why the hold-back exists


def test_streamed_choice_sends_prefix_once_and_finish_once():
    state = StreamedChoice(prefix="PROMPT ")
    completion = CompletionOutput(index=0, text="a", token_ids=[1])
    assert state.next_delta(completion, want_tokens=False) == ("PROMPT a", 0, None)
    completion.token_ids.append(2)  # a token that adds no text yet
    assert state.next_delta(completion, want_tokens=False) is None
    assert state.next_delta(completion, want_tokens=True) == ("", 1, None)
    completion.text, completion.finish_reason = "ab", "length"
    assert state.next_delta(completion, want_tokens=False) == ("b", 2, "length")
    assert state.next_delta(completion, want_tokens=False) is None


async def _numbers(name: str, count: int, closed: list[str], delay: float = 0.0):
    try:
        for i in range(count):
            await asyncio.sleep(delay)
            yield f"{name}{i}"
    finally:
        closed.append(name)


def test_merge_yields_everything_tagged_with_its_source():
    async def run():
        closed: list[str] = []
        items = [item async for item in merge_async_iterators(
            [_numbers("a", 3, closed), _numbers("b", 2, closed)])]
        return items, closed

    items, closed = asyncio.run(run())
    assert sorted(items) == [(0, "a0"), (0, "a1"), (0, "a2"), (1, "b0"), (1, "b1")]
    assert sorted(closed) == ["a", "b"]


def test_merge_closes_every_source_when_the_consumer_stops():
    async def run():
        closed: list[str] = []
        merged = merge_async_iterators([_numbers("a", 1000, closed, 0.001),
                                        _numbers("b", 1000, closed, 0.001)])
        first = await merged.__anext__()
        await merged.aclose()
        return first, closed

    first, closed = asyncio.run(run())
    assert first[1] in ("a0", "b0")
    assert sorted(closed) == ["a", "b"]


def test_merge_raises_a_source_error_and_closes_the_rest():
    async def failing():
        yield "x"
        raise ValueError("boom")

    async def run():
        closed: list[str] = []
        with pytest.raises(ValueError, match="boom"):
            async for _ in merge_async_iterators([failing(),
                                                  _numbers("slow", 1000, closed, 0.01)]):
                pass
        return closed

    assert asyncio.run(run()) == ["slow"]


def make_engine_client(model_dir: str) -> EngineClient:
    """A real EngineClient that has received two steps' stats (no engine needed for that)."""
    client = EngineClient(TokenizerInfo(model_dir), max_model_len=512, model_name="m")
    asyncio.run(client._handle_outputs(EngineCoreOutputs(scheduler_stats=SchedulerStats(
        num_preemptions=1, prefix_cache_queries=20, prefix_cache_hits=16))))
    asyncio.run(client._handle_outputs(EngineCoreOutputs(scheduler_stats=SchedulerStats(
        num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.25,
        prefix_cache_queries=12))))
    return client


def test_metrics_observe_a_request(default_model_dir):
    metrics = ApiMetrics(make_engine_client(default_model_dir), "m")

    async def outputs():
        for num_tokens in (1, 3, 4):
            yield RequestOutput("r", None, [7, 8, 9], [CompletionOutput(
                0, token_ids=list(range(num_tokens)),
                finish_reason="length" if num_tokens == 4 else None)],
                finished=num_tokens == 4)

    async def run():
        return [o async for o in metrics.observe(outputs())]

    assert len(asyncio.run(run())) == 3
    text = metrics.render()[0].decode()
    expected = {
        'kvserve:num_requests_running{model_name="m"}': 2.0,
        'kvserve:num_requests_waiting{model_name="m"}': 1.0,
        'kvserve:kv_cache_usage_perc{model_name="m"}': 0.25,
        'kvserve:num_preemptions_total{model_name="m"}': 1.0,
        'kvserve:prefix_cache_queries_total{model_name="m"}': 32.0,
        'kvserve:prefix_cache_hits_total{model_name="m"}': 16.0,
        'kvserve:prompt_tokens_total{model_name="m"}': 3.0,
        'kvserve:generation_tokens_total{model_name="m"}': 4.0,
        'kvserve:time_to_first_token_seconds_count{model_name="m"}': 1.0,
        'kvserve:inter_token_latency_seconds_count{model_name="m"}': 2.0,
        'kvserve:e2e_request_latency_seconds_count{model_name="m"}': 1.0,
        'kvserve:request_queue_time_seconds_count{model_name="m"}': 1.0,
    }
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines()
                   if line and not line.startswith("#"))
    for name, value in expected.items():
        assert float(samples[name]) == value, name
