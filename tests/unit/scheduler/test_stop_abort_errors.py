"""Stop conditions, aborts, and bad requests turned into error outputs."""

from __future__ import annotations

import pytest

from kvserve.services.scheduler.core.request import RequestStatus
from kvserve.shared.messages import FinishReason
from tests.support.kv import assert_no_leaked_blocks
from tests.support.scheduler import (
    EOS_TOKEN_ID,
    SAMPLED_TOKEN_ID,
    create_request,
    create_scheduler,
    run_to_completion,
    step,
    submit,
)


def generate(scheduler, req_id: str, token_ids: list[int]):
    """Feed `token_ids` one per step to request `req_id`; return all its outputs."""
    outputs = []
    for token_id in token_ids:
        _, step_outputs = step(scheduler, sampled={req_id: [token_id]})
        outputs += [out for out in step_outputs if out.request_id == req_id]
        if outputs and outputs[-1].finished:
            break
    return outputs


def collected_tokens(outputs) -> list[int]:
    return [token_id for out in outputs for token_id in out.new_token_ids]


# ---------------------------------------------------------------------- stop conditions


def test_max_tokens_caps_the_output():
    scheduler = create_scheduler()
    scheduler.add_request(create_request("a", max_tokens=3))
    outputs = generate(scheduler, "a", [5] * 10)
    assert collected_tokens(outputs) == [5, 5, 5]
    assert outputs[-1].finish_reason == FinishReason.LENGTH
    assert outputs[-1].stop_reason is None
    assert_no_leaked_blocks(scheduler)


def test_max_model_len_caps_the_output():
    scheduler = create_scheduler(max_model_len=32)
    scheduler.add_request(create_request("a", num_tokens=28, max_tokens=None))
    outputs = generate(scheduler, "a", [5] * 10)
    assert len(collected_tokens(outputs)) == 4  # 28 + 4 = max_model_len
    assert outputs[-1].finish_reason == FinishReason.LENGTH
    assert_no_leaked_blocks(scheduler)


def test_eos_stops_and_is_included():
    scheduler = create_scheduler()
    scheduler.add_request(create_request("a", max_tokens=10))
    outputs = generate(scheduler, "a", [5, 6, EOS_TOKEN_ID, 8])
    assert collected_tokens(outputs) == [5, 6, EOS_TOKEN_ID]
    assert outputs[-1].finish_reason == FinishReason.STOP
    assert outputs[-1].stop_reason is None
    assert_no_leaked_blocks(scheduler)


def test_ignore_eos_keeps_going():
    scheduler = create_scheduler()
    scheduler.add_request(create_request("a", max_tokens=3, ignore_eos=True))
    outputs = generate(scheduler, "a", [EOS_TOKEN_ID] * 5)
    assert collected_tokens(outputs) == [EOS_TOKEN_ID] * 3
    assert outputs[-1].finish_reason == FinishReason.LENGTH
    assert_no_leaked_blocks(scheduler)


def test_min_tokens_suppresses_eos_and_stop_tokens_until_reached():
    scheduler = create_scheduler()
    scheduler.add_request(create_request("a", max_tokens=10, min_tokens=3, stop_token_ids=[42]))
    outputs = generate(scheduler, "a", [EOS_TOKEN_ID, 42, EOS_TOKEN_ID, 9])
    assert collected_tokens(outputs) == [EOS_TOKEN_ID, 42, EOS_TOKEN_ID]
    assert outputs[-1].finish_reason == FinishReason.STOP
    assert_no_leaked_blocks(scheduler)


def test_stop_token_id_stops_with_its_reason():
    scheduler = create_scheduler()
    scheduler.add_request(create_request("a", max_tokens=10, stop_token_ids=[42, 43]))
    outputs = generate(scheduler, "a", [5, 43, 6])
    assert collected_tokens(outputs) == [5, 43]
    assert outputs[-1].finish_reason == FinishReason.STOP
    assert outputs[-1].stop_reason == 43
    assert_no_leaked_blocks(scheduler)


def test_no_eos_id_means_no_eos_stop():
    scheduler = create_scheduler()
    scheduler.add_request(create_request("a", max_tokens=2, eos_token_id=None))
    outputs = generate(scheduler, "a", [EOS_TOKEN_ID] * 3)
    assert outputs[-1].finish_reason == FinishReason.LENGTH
    assert_no_leaked_blocks(scheduler)


def test_several_tokens_in_one_step_stop_at_the_first_that_ends():
    scheduler = create_scheduler()
    scheduler.add_request(create_request("a", max_tokens=10, stop_token_ids=[42]))
    step(scheduler)
    _, outputs = step(scheduler, sampled={"a": [5, 42, 6, 7]})
    assert outputs[0].new_token_ids == [5, 42] and outputs[0].stop_reason == 42
    assert scheduler.schedule().finished_req_ids == ["a"]
    assert_no_leaked_blocks(scheduler)


# ---------------------------------------------------------------------- aborts


def test_abort_frees_blocks_at_once():
    scheduler = create_scheduler(max_num_seqs=1)
    scheduler.add_request(create_request("running", num_tokens=40, max_tokens=10))
    scheduler.add_request(create_request("waiting", num_tokens=40, max_tokens=10))
    step(scheduler)
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_total_blocks - 3
    scheduler.finish_requests(["running", "waiting", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert manager.num_free_blocks == manager.num_total_blocks
    assert not scheduler.has_unfinished_requests() and len(scheduler.waiting) == 0
    # Aborting twice is a no-op; the workers hear of both ids once.
    scheduler.finish_requests("running", RequestStatus.FINISHED_ABORTED)
    scheduler_output = scheduler.schedule()
    assert scheduler_output.finished_req_ids == ["running", "waiting"]
    assert scheduler_output.total_num_scheduled_tokens == 0
    with pytest.raises(ValueError, match="FINISHED"):
        scheduler.finish_requests("x", RequestStatus.RUNNING)
    assert_no_leaked_blocks(scheduler)


def test_abort_of_a_preempted_request():
    scheduler = create_scheduler(block_size=4, num_blocks=5, max_model_len=16)
    scheduler.add_request(create_request("a", num_tokens=6, max_tokens=4))
    scheduler.add_request(create_request("b", num_tokens=8, max_tokens=4))
    step(scheduler)
    assert step(scheduler)[0].preempted_req_ids == ["b"]
    scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert len(scheduler.waiting) == 0
    finals = run_to_completion(scheduler)
    assert list(finals) == ["a"]
    assert_no_leaked_blocks(scheduler)


# ---------------------------------------------------------------------- bad requests


@pytest.mark.parametrize(
    "prompt_token_ids, message",
    [
        ([], "empty"),
        (list(range(64)), "max_model_len"),
        (list(range(100)), "max_model_len"),
        ([1, -5, 3], "token ids"),
        ([1, 2**31], "token ids"),
    ],
)
def test_bad_request_becomes_an_error_output(prompt_token_ids, message):
    scheduler = create_scheduler(max_model_len=64)
    scheduler.add_request(create_request("good", max_tokens=1))
    submit(scheduler, create_request("bad", prompt_token_ids=prompt_token_ids))
    assert scheduler.get_num_unfinished_requests() == 1
    assert scheduler.has_requests()
    scheduler_output, outputs = step(scheduler)
    assert list(scheduler_output.num_scheduled_tokens) == ["good"]
    by_id = {out.request_id: out for out in outputs}
    assert by_id["bad"].finish_reason == FinishReason.ERROR
    assert message in by_id["bad"].error and by_id["bad"].new_token_ids == []
    assert by_id["good"].new_token_ids == [SAMPLED_TOKEN_ID]
    run_to_completion(scheduler)
    assert_no_leaked_blocks(scheduler)


def test_duplicate_request_id_is_rejected_without_harming_the_first():
    scheduler = create_scheduler()
    scheduler.add_request(create_request("a", max_tokens=2))
    submit(scheduler, create_request("a", max_tokens=5))
    _, outputs = step(scheduler)
    errors = [out for out in outputs if out.finish_reason == FinishReason.ERROR]
    assert len(errors) == 1 and "already in use" in errors[0].error
    finals = run_to_completion(scheduler)
    assert finals["a"].finish_reason == FinishReason.LENGTH
    assert_no_leaked_blocks(scheduler)


def test_error_outputs_flush_even_with_nothing_to_run():
    scheduler = create_scheduler()
    submit(scheduler, create_request("bad", prompt_token_ids=[]))
    assert not scheduler.has_unfinished_requests() and scheduler.has_requests()
    scheduler_output, outputs = step(scheduler)
    assert scheduler_output.total_num_scheduled_tokens == 0
    assert [out.request_id for out in outputs] == ["bad"]
    assert not scheduler.has_requests()
    assert_no_leaked_blocks(scheduler)


def test_chunking_off_with_a_budget_below_max_model_len_is_refused():
    with pytest.raises(ValueError, match="chunked prefill"):
        create_scheduler(
            enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=1024
        )


def test_max_model_len_is_capped_to_what_the_cache_holds():
    # 7 usable blocks of 16 = 112 tokens: a longer request would preempt itself forever.
    scheduler = create_scheduler(block_size=16, num_blocks=8, max_model_len=1024)
    assert scheduler.max_model_len == 112
    submit(scheduler, create_request("too_long", num_tokens=200))
    scheduler.add_request(create_request("fits", num_tokens=100, max_tokens=None))
    finals = run_to_completion(scheduler)
    assert finals["too_long"].finish_reason == FinishReason.ERROR
    assert "max_model_len is 112" in finals["too_long"].error
    assert finals["fits"].finish_reason == FinishReason.LENGTH
    assert_no_leaked_blocks(scheduler)
