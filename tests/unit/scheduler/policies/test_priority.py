"""--scheduling-policy priority: its queue, admission by (priority, arrival) and the
least important request preempted first."""

from __future__ import annotations

from kvserve.services.scheduler.core.policies.priority import PriorityRequestQueue
from kvserve.services.scheduler.core.request import Request, RequestStatus
from kvserve.shared.sampling_params import SamplingParams
from tests.support.kv import assert_no_leaked_blocks
from tests.support.scheduler import create_request, create_scheduler, run_to_completion, step


def make_request(req_id: str, priority: int, arrival_time: float) -> Request:
    return Request(
        req_id, list(range(6)), SamplingParams(), priority=priority, arrival_time=arrival_time
    )


def test_priority_queue_orders_by_priority_then_arrival():
    queue = PriorityRequestQueue()
    late_urgent = make_request("late_urgent", priority=0, arrival_time=5.0)
    early_urgent = make_request("early_urgent", priority=0, arrival_time=1.0)
    low = make_request("low", priority=3, arrival_time=0.0)
    mid = make_request("mid", priority=1, arrival_time=2.0)
    for request in (low, late_urgent, mid, early_urgent):
        queue.add_request(request)
    assert list(queue) == [early_urgent, late_urgent, mid, low]
    assert queue.pop_request() is early_urgent
    # A preempted request keeps its key: ahead of later arrivals at its priority.
    queue.prepend_request(early_urgent)
    assert queue.peek_request() is early_urgent
    queue.remove_requests([early_urgent, mid])
    assert [queue.pop_request() for _ in range(len(queue))] == [late_urgent, low]


def test_priority_admits_lowest_priority_value_then_earliest():
    scheduler = create_scheduler(max_num_seqs=1, scheduling_policy="priority")
    for req_id, priority, arrival in (
        ("p3", 3, 0.0),
        ("p1_late", 1, 2.0),
        ("p2", 2, 1.0),
        ("p1_early", 1, 0.5),
    ):
        scheduler.add_request(
            create_request(req_id, max_tokens=1, priority=priority, arrival_time=arrival)
        )
    order = [next(iter(step(scheduler)[0].num_scheduled_tokens)) for _ in range(4)]
    assert order == ["p1_early", "p1_late", "p2", "p3"]
    assert_no_leaked_blocks(scheduler)


def test_priority_preempts_the_lowest_priority_even_if_already_scheduled():
    scheduler = create_scheduler(
        block_size=4, num_blocks=5, max_model_len=16, scheduling_policy="priority"
    )
    scheduler.add_request(create_request("low", num_tokens=5, max_tokens=8, priority=5))
    step(scheduler)
    scheduler.add_request(
        create_request("high", num_tokens=8, max_tokens=3, priority=0, arrival_time=1.0)
    )
    step(scheduler)  # low decodes in place, high takes the last two blocks
    assert scheduler.kv_cache_manager.num_free_blocks == 0

    # "low" runs first and fits; "high" needs a block, so "low" loses its slot in the step.
    scheduler_output, _ = step(scheduler)
    assert scheduler_output.preempted_req_ids == ["low"]
    assert scheduler_output.num_scheduled_tokens == {"high": 1}
    assert scheduler_output.scheduled_cached_reqs.req_ids == ["high"]
    assert scheduler_output.total_num_scheduled_tokens == 1
    assert scheduler.requests["low"].status == RequestStatus.PREEMPTED
    finals = run_to_completion(scheduler)
    assert len(finals["low"].new_token_ids) == 1 and sorted(finals) == ["high", "low"]
    assert_no_leaked_blocks(scheduler)
