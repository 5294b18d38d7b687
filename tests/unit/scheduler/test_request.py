"""Request state and incremental block hashes (the waiting queues: policies/)."""

from __future__ import annotations

import pytest

from kvserve.services.scheduler.core.request import Request, RequestStatus, make_block_hasher
from kvserve.shared.hashing import get_hash_fn, hash_new_full_blocks, make_extra_keys
from kvserve.shared.messages import EngineCoreRequest, FinishReason
from kvserve.shared.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(
    req_id: str = "r", num_tokens: int = 6, priority: int = 0, arrival_time: float = 0.0
) -> Request:
    return Request(
        req_id,
        list(range(num_tokens)),
        SamplingParams(),
        priority=priority,
        arrival_time=arrival_time,
    )


def test_from_engine_core_request_copies_every_field():
    hasher = make_block_hasher(BLOCK_SIZE, get_hash_fn("sha256"))
    engine_request = EngineCoreRequest(
        request_id="abc",
        prompt_token_ids=[5, 6, 7, 8, 9],
        eos_token_id=2,
        sampling_params=SamplingParams(max_tokens=3, stop_token_ids=[11, 12]),
        arrival_time=12.5,
        priority=-1,
        cache_salt="salt",
    )
    request = Request.from_engine_core_request(engine_request, hasher)
    assert (request.req_id, request.prompt_token_ids, request.eos_token_id) == (
        "abc",
        [5, 6, 7, 8, 9],
        2,
    )
    assert (request.arrival_time, request.priority, request.cache_salt) == (12.5, -1, "salt")
    assert request.max_tokens == 3 and request.stop_token_ids == {11, 12}
    assert request.status == RequestStatus.WAITING
    assert (request.num_tokens, request.num_prompt_tokens, request.num_output_tokens) == (5, 5, 0)
    assert request.num_computed_tokens == 0 and request.num_cached_tokens == -1
    assert request.num_preemptions == 0
    assert len(request.block_hashes) == 1
    # The prompt list is copied: appending outputs must not touch the message.
    request.append_output_token_ids(1)
    assert engine_request.prompt_token_ids == [5, 6, 7, 8, 9]


def test_block_hashes_grow_as_outputs_fill_blocks():
    hash_fn = get_hash_fn("sha256")
    request = Request(
        "r",
        [1, 2, 3, 4, 5, 6],
        SamplingParams(),
        cache_salt="s",
        block_hasher=make_block_hasher(BLOCK_SIZE, hash_fn),
    )
    assert len(request.block_hashes) == 1
    request.append_output_token_ids(7)
    assert len(request.block_hashes) == 1
    request.append_output_token_ids([8, 9, 10, 11, 12])
    assert len(request.block_hashes) == 3
    assert request.output_token_ids == [7, 8, 9, 10, 11, 12]
    assert request.all_token_ids == list(range(1, 13))
    assert request.block_hashes == hash_new_full_blocks(
        hash_fn, BLOCK_SIZE, list(range(1, 13)), [], make_extra_keys("s")
    )


def test_no_hasher_means_no_hashes():
    request = make_request(num_tokens=8)
    request.append_output_token_ids([1, 2, 3, 4])
    assert request.block_hashes == []


@pytest.mark.parametrize(
    "status, reason",
    [
        (RequestStatus.WAITING, None),
        (RequestStatus.RUNNING, None),
        (RequestStatus.PREEMPTED, None),
        (RequestStatus.FINISHED_STOPPED, FinishReason.STOP),
        (RequestStatus.FINISHED_LENGTH_CAPPED, FinishReason.LENGTH),
        (RequestStatus.FINISHED_ABORTED, FinishReason.ABORT),
        (RequestStatus.FINISHED_ERROR, FinishReason.ERROR),
    ],
)
def test_finished_reason_follows_status(status, reason):
    request = make_request()
    request.status = status
    assert request.is_finished == (reason is not None)
    assert request.get_finished_reason() == reason


def test_prompt_logprobs_skip_cache_reads():
    assert not make_request().skip_reading_prefix_cache
    request = Request("r", [1], SamplingParams(prompt_logprobs=0))
    assert request.skip_reading_prefix_cache
