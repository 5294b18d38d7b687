"""Preemption by recompute when the KV cache runs out (block_size 4, tiny pools)."""

from __future__ import annotations

from kvserve.services.scheduler.core.request import RequestStatus
from kvserve.shared.messages import FinishReason
from tests.support.kv import assert_no_leaked_blocks
from tests.support.scheduler import (
    SAMPLED_TOKEN_ID,
    create_request,
    create_scheduler,
    run_to_completion,
    step,
)


def test_fcfs_preempts_the_last_running_request_and_resumes_it():
    # 6 usable blocks of 4 tokens: three 8-token prompts fill the cache exactly.
    scheduler = create_scheduler(block_size=4, num_blocks=7, max_model_len=24)
    for index, req_id in enumerate("abc"):
        scheduler.add_request(
            create_request(req_id, num_tokens=8, max_tokens=6, arrival_time=float(index))
        )
    step(scheduler)
    assert scheduler.kv_cache_manager.num_free_blocks == 0

    # Token 9 of "a" needs a third block: "c", last in line, makes room for "a" and "b".
    scheduler_output, _ = step(scheduler)
    assert scheduler_output.preempted_req_ids == ["c"]
    assert scheduler_output.num_scheduled_tokens == {"a": 1, "b": 1}
    request_c = scheduler.requests["c"]
    assert request_c.status == RequestStatus.PREEMPTED
    assert request_c.num_computed_tokens == 0 and request_c.num_preemptions == 1
    assert scheduler.waiting.peek_request() is request_c
    assert [r.req_id for r in scheduler.running] == ["a", "b"]
    assert scheduler.num_preemptions_total == 1
    assert scheduler.make_stats().num_preemptions == 1

    resumed = None
    finals, cached_of_c = {}, []
    for _ in range(50):
        if not scheduler.has_requests():
            break
        scheduler_output, outputs = step(scheduler)
        finals.update({out.request_id: out for out in outputs if out.finished})
        cached_of_c += [out.num_cached_tokens for out in outputs if out.request_id == "c"]
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id == "c" and resumed is None:
                resumed = new
    # Resumed in full, with the output it had before, to recompute everything.
    assert resumed is not None and resumed.output_token_ids == [SAMPLED_TOKEN_ID]
    assert resumed.num_computed_tokens % 4 == 0  # prefix hits are whole blocks
    assert sorted(finals) == ["a", "b", "c"]
    assert all(out.finish_reason == FinishReason.LENGTH for out in finals.values())
    # num_cached_tokens is the first schedule's (a cold 0), never the resume's hit.
    assert cached_of_c and cached_of_c == [0] * len(cached_of_c)
    # After c, b: when a needs its fourth block, b is the last running request.
    assert scheduler.num_preemptions_total == 2
    assert_no_leaked_blocks(scheduler)


def test_a_request_preempts_itself_when_it_is_last():
    scheduler = create_scheduler(block_size=4, num_blocks=5, max_model_len=16)
    scheduler.add_request(create_request("a", num_tokens=6, max_tokens=4))
    scheduler.add_request(create_request("b", num_tokens=8, max_tokens=4))
    step(scheduler)  # a: 2 blocks, b: 2 blocks, none left
    scheduler_output, _ = step(scheduler)
    # "a" still has room in its second block; "b" needs a third and is the last in line.
    assert scheduler_output.num_scheduled_tokens == {"a": 1}
    assert scheduler_output.preempted_req_ids == ["b"]
    # b's blocks went back tail first; a's third block evicts b's tail, b's head stays cached.
    resumed, finals, cached_of_b = None, {}, []
    while scheduler.has_requests():
        scheduler_output, outputs = step(scheduler)
        finals.update({out.request_id: out for out in outputs if out.finished})
        cached_of_b += [out.num_cached_tokens for out in outputs if out.request_id == "b"]
        resumed = resumed or next(
            (new for new in scheduler_output.scheduled_new_reqs if new.req_id == "b"), None
        )
    assert resumed.num_computed_tokens == 4
    assert resumed.output_token_ids == [SAMPLED_TOKEN_ID]
    # num_cached_tokens reports the first schedule's hit (0), not the resume's 4.
    assert cached_of_b and cached_of_b == [0] * len(cached_of_b)
    assert finals["b"].finish_reason == FinishReason.LENGTH
    assert_no_leaked_blocks(scheduler)


def test_no_waiting_request_is_admitted_in_a_step_that_preempted():
    # 7 usable blocks: a (8 tokens) and b (6 tokens) take 2 each, c (12 tokens) takes 3.
    scheduler = create_scheduler(
        block_size=4, num_blocks=8, max_model_len=28, scheduling_policy="priority"
    )
    for req_id, num_tokens, priority, arrival in (
        ("a", 8, 1, 0.0),
        ("b", 6, 1, 1.0),
        ("c", 12, 2, 2.0),
    ):
        scheduler.add_request(
            create_request(
                req_id, num_tokens=num_tokens, max_tokens=4, priority=priority, arrival_time=arrival
            )
        )
    step(scheduler)
    scheduler.add_request(
        create_request("urgent", num_tokens=2, max_tokens=1, priority=0, arrival_time=3.0)
    )
    scheduler_output, _ = step(scheduler)
    assert scheduler_output.preempted_req_ids == ["c"]
    # Preempting c freed 3 blocks and a took 1: "urgent" would fit but must wait a step.
    assert scheduler.kv_cache_manager.num_free_blocks == 2
    assert scheduler_output.scheduled_new_reqs == []
    scheduler_output, _ = step(scheduler)
    assert [new.req_id for new in scheduler_output.scheduled_new_reqs] == ["urgent"]
    run_to_completion(scheduler)
    assert_no_leaked_blocks(scheduler)


def test_prompt_logprobs_are_not_repeated_after_a_preemption_mid_prompt():
    """b is preempted after two prompt chunks; its recompute must send each position once."""
    from kvserve.shared.messages import Logprobs, ModelRunnerOutput

    prompt_len = 12

    def fake_runner(scheduler_output) -> ModelRunnerOutput:
        # Row for prompt position p carries p, so the test can see which ones arrive; the
        # last prompt position has no next prompt token, hence no row.
        req_ids = list(scheduler_output.num_scheduled_tokens)
        prompt_logprobs = {}
        if "b" in scheduler_output.num_scheduled_tokens:
            end = scheduler.requests["b"].num_computed_tokens
            start = end - scheduler_output.num_scheduled_tokens["b"]
            positions = list(range(start, min(end, prompt_len - 1)))
            if positions:
                prompt_logprobs["b"] = Logprobs(
                    token_ids=[[p] for p in positions],
                    logprobs=[[-1.0]] * len(positions),
                    ranks=[1] * len(positions),
                )
        sampled = [
            [SAMPLED_TOKEN_ID]
            if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens
            else []
            for r in req_ids
        ]
        return ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=sampled, prompt_logprobs=prompt_logprobs
        )

    scheduler = create_scheduler(
        block_size=4, num_blocks=5, max_model_len=16, max_num_batched_tokens=4
    )
    scheduler.add_request(create_request("a", num_tokens=4, max_tokens=6))
    scheduler.add_request(
        create_request("b", num_tokens=prompt_len, max_tokens=1, prompt_logprobs=0)
    )
    received, preempted = [], []
    for _ in range(40):
        if not scheduler.has_requests():
            break
        scheduler_output = scheduler.schedule()
        preempted += scheduler_output.preempted_req_ids
        for out in scheduler.update_from_output(scheduler_output, fake_runner(scheduler_output)):
            if out.new_prompt_logprobs is not None:
                received += [row[0] for row in out.new_prompt_logprobs.token_ids]
    assert preempted and set(preempted) == {"b"}
    assert received == list(range(prompt_len - 1))
    assert_no_leaked_blocks(scheduler)
