"""--scheduling-policy priority: the lowest priority value first, then the earliest arrival."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator

from kvserve.services.scheduler.core.policies.base import SchedulingPolicy
from kvserve.services.scheduler.core.request import Request
from kvserve.services.scheduler.core.request_queue import RequestQueue
from kvserve.shared.config import SchedulerConfig


class PriorityRequestQueue(RequestQueue):
    """Lowest (priority, arrival_time) first, as a binary heap.

    A preempted request keeps its key, so it goes back ahead of everything that arrived after
    it at its priority; a sequence number breaks exact ties without comparing Requests.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def add_request(self, request: Request) -> None:
        heapq.heappush(
            self._heap, (request.priority, request.arrival_time, next(self._seq), request)
        )

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def peek_request(self) -> Request:
        return self._heap[0][-1]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = {id(request) for request in requests}
        self._heap = [entry for entry in self._heap if id(entry[-1]) not in to_remove]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[-1] for entry in sorted(self._heap))


class PriorityPolicy(SchedulingPolicy):
    """Admitted by (priority, arrival_time); the least important running request, then the
    latest, is preempted first.

    Args:
        scheduler_config: the scheduler's config.
    """

    name = "priority"

    def __init__(self, scheduler_config: SchedulerConfig) -> None:
        super().__init__(scheduler_config)
        self.waiting = PriorityRequestQueue()

    def pick_preemption_victim(self, running: list[Request]) -> Request:
        # Largest (priority, arrival_time): least important, then latest; on exact ties
        # the last admitted (max keeps the first maximum it meets).
        return max(reversed(running), key=lambda r: (r.priority, r.arrival_time))
