"""--scheduling-policy fcfs: first come, first served."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from kvserve.services.scheduler.core.policies.base import SchedulingPolicy
from kvserve.services.scheduler.core.request import Request
from kvserve.services.scheduler.core.request_queue import RequestQueue
from kvserve.shared.config import SchedulerConfig


class FcfsRequestQueue(RequestQueue):
    """Arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._requests: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._requests.append(request)

    def prepend_request(self, request: Request) -> None:
        self._requests.appendleft(request)

    def peek_request(self) -> Request:
        return self._requests[0]

    def pop_request(self) -> Request:
        return self._requests.popleft()

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = {id(request) for request in requests}
        self._requests = deque(r for r in self._requests if id(r) not in to_remove)

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)


class FcfsPolicy(SchedulingPolicy):
    """Admitted in arrival order; the last admitted is preempted first.

    Args:
        scheduler_config: the scheduler's config.
    """

    name = "fcfs"

    def __init__(self, scheduler_config: SchedulerConfig) -> None:
        super().__init__(scheduler_config)
        self.waiting = FcfsRequestQueue()

    def pick_preemption_victim(self, running: list[Request]) -> Request:
        return running[-1]
