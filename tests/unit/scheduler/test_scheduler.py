"""Scheduler steps with a fake model: budgets, chunking, admission, prefix hits, outputs."""

from __future__ import annotations

import pytest

from kvserve.services.scheduler.core.request import RequestStatus
from kvserve.shared.messages import FinishReason, ModelRunnerOutput
from tests.support.kv import assert_no_leaked_blocks
from tests.support.scheduler import (
    SAMPLED_TOKEN_ID,
    create_request,
    create_scheduler,
    make_runner_output,
    run_to_completion,
    step,
)


def test_prompts_then_decodes_until_max_tokens():
    scheduler = create_scheduler()
    for req_id in ("a", "b", "c"):
        scheduler.add_request(create_request(req_id, num_tokens=20, max_tokens=3))
    first, outputs = step(scheduler)
    assert [new.req_id for new in first.scheduled_new_reqs] == ["a", "b", "c"]
    assert first.num_scheduled_tokens == {"a": 20, "b": 20, "c": 20}
    assert first.total_num_scheduled_tokens == 60
    new_a = first.scheduled_new_reqs[0]
    assert (new_a.num_computed_tokens, len(new_a.block_ids), new_a.output_token_ids) == (0, 2, [])
    assert [out.new_token_ids for out in outputs] == [[SAMPLED_TOKEN_ID]] * 3
    assert all(out.num_cached_tokens == 0 and not out.finished for out in outputs)

    second, _ = step(scheduler)
    assert second.scheduled_new_reqs == []
    cached = second.scheduled_cached_reqs
    assert cached.req_ids == ["a", "b", "c"]
    assert cached.num_computed_tokens == [20, 20, 20]
    assert cached.new_block_ids == [[], [], []]
    assert second.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1}

    _, outputs = step(scheduler)
    assert all(out.finish_reason == FinishReason.LENGTH for out in outputs)
    assert scheduler.schedule().finished_req_ids == ["a", "b", "c"]
    assert_no_leaked_blocks(scheduler)


def test_token_budget_caps_a_step_and_chunks_the_last_prompt():
    scheduler = create_scheduler(max_num_batched_tokens=100)
    for req_id in ("a", "b", "c"):
        scheduler.add_request(create_request(req_id, num_tokens=60, max_tokens=2))
    first, outputs = step(scheduler)
    assert first.num_scheduled_tokens == {"a": 60, "b": 40}
    assert [out.request_id for out in outputs] == ["a"]  # b's prompt is not done yet
    second, _ = step(scheduler)
    # Running first: a decodes, b finishes its prompt, c gets the rest of the budget.
    assert second.num_scheduled_tokens == {"a": 1, "b": 20, "c": 60}
    assert second.total_num_scheduled_tokens <= 100
    run_to_completion(scheduler)
    assert_no_leaked_blocks(scheduler)


def test_chunked_prefill_splits_a_long_prompt():
    scheduler = create_scheduler(max_num_batched_tokens=32)
    scheduler.add_request(create_request("a", num_tokens=100, max_tokens=1))
    chunks, computed_before = [], []
    while True:
        scheduler_output, outputs = step(scheduler)
        chunks.append(scheduler_output.num_scheduled_tokens["a"])
        if scheduler_output.scheduled_cached_reqs.req_ids:
            computed_before.append(scheduler_output.scheduled_cached_reqs.num_computed_tokens[0])
        if outputs:
            break
    assert chunks == [32, 32, 32, 4]
    assert computed_before == [32, 64, 96]
    assert outputs[0].finish_reason == FinishReason.LENGTH
    assert_no_leaked_blocks(scheduler)


def test_no_partial_prefill_without_chunking():
    scheduler = create_scheduler(
        max_num_batched_tokens=128, enable_chunked_prefill=False, max_model_len=128
    )
    scheduler.add_request(create_request("a", num_tokens=100, max_tokens=1))
    scheduler.add_request(create_request("b", num_tokens=100, max_tokens=1))
    first, _ = step(scheduler)
    assert first.num_scheduled_tokens == {"a": 100}  # b would need a partial prefill
    second, _ = step(scheduler)
    assert second.num_scheduled_tokens == {"b": 100}
    run_to_completion(scheduler)
    assert_no_leaked_blocks(scheduler)


def test_long_prefill_token_threshold_caps_each_prompt_chunk():
    scheduler = create_scheduler(long_prefill_token_threshold=16)
    scheduler.add_request(create_request("short", num_tokens=5, max_tokens=10))
    scheduler.add_request(create_request("long", num_tokens=50, max_tokens=1))
    scheduled = [step(scheduler)[0].num_scheduled_tokens for _ in range(4)]
    assert scheduled == [
        {"short": 5, "long": 16},
        {"short": 1, "long": 16},
        {"short": 1, "long": 16},
        {"short": 1, "long": 2},
    ]
    run_to_completion(scheduler)
    assert_no_leaked_blocks(scheduler)


def test_max_num_seqs_caps_running_requests():
    scheduler = create_scheduler(max_num_seqs=2)
    for req_id in ("a", "b", "c"):
        scheduler.add_request(create_request(req_id, max_tokens=2))
    first, _ = step(scheduler)
    assert list(first.num_scheduled_tokens) == ["a", "b"]
    assert scheduler.get_num_unfinished_requests() == 3
    second, _ = step(scheduler)
    assert list(second.num_scheduled_tokens) == ["a", "b"]  # both finish here
    third, _ = step(scheduler)
    assert list(third.num_scheduled_tokens) == ["c"]
    assert third.finished_req_ids == ["a", "b"]
    run_to_completion(scheduler)
    assert_no_leaked_blocks(scheduler)


def test_prefix_hit_of_a_200_token_shared_prefix():
    scheduler = create_scheduler()
    prefix = list(range(3000, 3200))
    scheduler.add_request(create_request("a", prompt_token_ids=prefix + [1, 2], max_tokens=2))
    step(scheduler)
    scheduler.add_request(create_request("b", prompt_token_ids=prefix + [5, 6, 7], max_tokens=2))
    scheduler_output, outputs = step(scheduler)
    new_b = scheduler_output.scheduled_new_reqs[0]
    assert new_b.num_computed_tokens >= 192
    assert scheduler_output.num_scheduled_tokens["b"] == 203 - new_b.num_computed_tokens
    assert {out.request_id: out.num_cached_tokens for out in outputs}["b"] >= 192
    stats = scheduler.make_stats()
    assert stats.prefix_cache_queries == 202 + 203 and stats.prefix_cache_hits == 192
    run_to_completion(scheduler)
    assert_no_leaked_blocks(scheduler)


def test_requests_admitted_together_hit_each_others_blocks():
    scheduler = create_scheduler()
    prompt = list(range(500, 550))
    scheduler.add_request(create_request("a", prompt_token_ids=prompt, max_tokens=1))
    scheduler.add_request(create_request("b", prompt_token_ids=prompt, max_tokens=1))
    scheduler_output, _ = step(scheduler)
    assert scheduler_output.num_scheduled_tokens == {"a": 50, "b": 2}
    new_a, new_b = scheduler_output.scheduled_new_reqs
    assert new_b.block_ids[:3] == new_a.block_ids[:3]
    run_to_completion(scheduler)
    assert_no_leaked_blocks(scheduler)


def test_prompt_logprobs_requests_get_no_prefix_hits():
    scheduler = create_scheduler()
    prompt = list(range(700, 740))
    scheduler.add_request(create_request("a", prompt_token_ids=prompt, max_tokens=1))
    step(scheduler)
    scheduler.add_request(
        create_request("b", prompt_token_ids=prompt, max_tokens=1, prompt_logprobs=2)
    )
    scheduler_output, _ = step(scheduler)
    assert scheduler_output.num_scheduled_tokens == {"b": 40}
    assert scheduler_output.scheduled_new_reqs[0].num_computed_tokens == 0
    run_to_completion(scheduler)
    assert_no_leaked_blocks(scheduler)


def test_reset_prefix_cache():
    scheduler = create_scheduler()
    prompt = list(range(800, 840))
    scheduler.add_request(create_request("a", prompt_token_ids=prompt, max_tokens=2))
    step(scheduler)
    assert not scheduler.reset_prefix_cache()  # "a" still holds blocks
    run_to_completion(scheduler)
    assert scheduler.reset_prefix_cache()
    scheduler.add_request(create_request("b", prompt_token_ids=prompt, max_tokens=1))
    scheduler_output, _ = step(scheduler)
    assert scheduler_output.num_scheduled_tokens == {"b": 40}
    run_to_completion(scheduler)
    assert_no_leaked_blocks(scheduler)


def test_stats_are_per_step():
    scheduler = create_scheduler()
    scheduler.add_request(create_request("a", num_tokens=40, max_tokens=5))
    scheduler.add_request(create_request("b", num_tokens=40, max_tokens=5))
    step(scheduler)
    stats = scheduler.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (2, 0)
    assert stats.prefix_cache_queries == 80 and stats.prefix_cache_hits == 0
    assert stats.kv_cache_usage == pytest.approx(6 / 999)
    again = scheduler.make_stats()
    assert again.prefix_cache_queries == 0 and again.num_preemptions == 0
    assert create_scheduler(log_stats=False).make_stats() is None
    run_to_completion(scheduler)
    assert_no_leaked_blocks(scheduler)


def test_update_ignores_a_request_aborted_during_the_step():
    scheduler = create_scheduler()
    scheduler.add_request(create_request("a", max_tokens=5))
    scheduler.add_request(create_request("b", max_tokens=5))
    scheduler_output = scheduler.schedule()
    runner_output = make_runner_output(scheduler, scheduler_output)
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    outputs = scheduler.update_from_output(scheduler_output, runner_output)
    assert [out.request_id for out in outputs] == ["b"]
    run_to_completion(scheduler)
    assert_no_leaked_blocks(scheduler)


def test_sampled_logprobs_are_forwarded_and_trimmed():
    from kvserve.shared.messages import Logprobs

    scheduler = create_scheduler()
    scheduler.add_request(create_request("a", max_tokens=1, logprobs=1))
    scheduler_output = scheduler.schedule()
    logprobs = Logprobs(
        token_ids=[[7, 7, 3], [8, 8, 3]], logprobs=[[-0.1, -0.1, -2.0]] * 2, ranks=[1, 1]
    )
    runner_output = ModelRunnerOutput(
        req_ids=["a"], sampled_token_ids=[[7, 8]], logprobs={"a": logprobs}
    )
    (output,) = scheduler.update_from_output(scheduler_output, runner_output)
    # max_tokens=1: the second token is dropped, and so is its logprobs row.
    assert output.new_token_ids == [7]
    assert output.new_logprobs.token_ids == [[7, 7, 3]] and output.new_logprobs.ranks == [1]
    assert_no_leaked_blocks(scheduler)


def test_has_requests_until_finished_ids_are_delivered():
    scheduler = create_scheduler()
    scheduler.add_request(create_request("a", max_tokens=1))
    step(scheduler)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.has_requests()  # the workers still hold "a"
    scheduler_output, outputs = step(scheduler)
    assert scheduler_output.finished_req_ids == ["a"]
    assert scheduler_output.total_num_scheduled_tokens == 0 and outputs == []
    assert not scheduler.has_requests()
    assert_no_leaked_blocks(scheduler)
