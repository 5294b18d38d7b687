"""--scheduling-policy fcfs: its queue, and admission in arrival order (the victim, the last
admitted: test_preemption.py)."""

from __future__ import annotations

import pytest

from kvserve.services.scheduler.core.policies.fcfs import FcfsRequestQueue
from kvserve.services.scheduler.core.request import Request
from kvserve.shared.sampling_params import SamplingParams
from tests.support.kv import assert_no_leaked_blocks
from tests.support.scheduler import create_request, create_scheduler, run_to_completion, step


def make_request(req_id: str) -> Request:
    return Request(req_id, list(range(6)), SamplingParams())


def test_fcfs_queue_order_prepend_and_remove():
    queue = FcfsRequestQueue()
    a, b, c, d = (make_request(name) for name in "abcd")
    for request in (a, b, c):
        queue.add_request(request)
    queue.prepend_request(d)
    assert list(queue) == [d, a, b, c] and len(queue) == 4
    queue.remove_requests([a, c])
    assert queue.peek_request() is d
    assert queue.pop_request() is d and queue.pop_request() is b
    assert not queue
    with pytest.raises(IndexError):
        queue.peek_request()


def test_fcfs_admits_in_arrival_order():
    scheduler = create_scheduler(max_num_seqs=1)
    for req_id, priority in (("first", 5), ("second", 0), ("third", 1)):
        scheduler.add_request(create_request(req_id, max_tokens=1, priority=priority))
    order = [next(iter(step(scheduler)[0].num_scheduled_tokens)) for _ in range(3)]
    assert order == ["first", "second", "third"]
    run_to_completion(scheduler)
    assert_no_leaked_blocks(scheduler)
