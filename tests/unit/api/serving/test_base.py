"""Stream deltas with stop-string hold-back, merging of request streams."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.services.api.serving.base import StreamedChoice, merge_async_iterators
from kvserve.services.api.serving.outputs import CompletionOutput
from kvserve.services.api.serving.stop_strings import check_stop_strings


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
            completion.text = completion.text[: hit[1]]
            completion.finish_reason = "stop"
        elif i == len(steps) - 1:
            completion.finish_reason = "length"
        delta = state.next_delta(completion, want_tokens=False)
        if delta is not None:
            streamed += delta[0]
        if completion.finish_reason:
            break
    return streamed, completion.text


@pytest.mark.parametrize(
    "steps, stop",
    [
        (["Hello", " wor", "ld", " again"], ["world"]),  # stop string across two steps
        (["ab", "c", "de", "f"], ["cd"]),
        (["one", " two", " three"], ["zzz"]),  # never hits: everything comes out at the end
        (["x", "yz"], ["xyz", "y"]),
    ],
)
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
        items = [
            item
            async for item in merge_async_iterators(
                [_numbers("a", 3, closed), _numbers("b", 2, closed)]
            )
        ]
        return items, closed

    items, closed = asyncio.run(run())
    assert sorted(items) == [(0, "a0"), (0, "a1"), (0, "a2"), (1, "b0"), (1, "b1")]
    assert sorted(closed) == ["a", "b"]


def test_merge_closes_every_source_when_the_consumer_stops():
    async def run():
        closed: list[str] = []
        # b waits ten times longer for each item, so a0 is the first to arrive.
        merged = merge_async_iterators(
            [_numbers("a", 1000, closed, 0.001), _numbers("b", 1000, closed, 0.01)]
        )
        first = await merged.__anext__()
        await merged.aclose()
        return first, closed

    first, closed = asyncio.run(run())
    assert first == (0, "a0")
    assert sorted(closed) == ["a", "b"]


def test_merge_raises_a_source_error_and_closes_the_rest():
    async def failing():
        yield "x"
        raise ValueError("boom")

    async def run():
        closed: list[str] = []
        with pytest.raises(ValueError, match="boom"):
            async for _ in merge_async_iterators([failing(), _numbers("slow", 1000, closed, 0.01)]):
                pass
        return closed

    assert asyncio.run(run()) == ["slow"]
