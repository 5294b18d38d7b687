"""--scheduling-policy fcfs: first come, first served."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from kvserve.services.scheduler.core.policies.base import SchedulingPolicy
from kvserve.services.scheduler.core.policies.deadline_queue import DeadlineQueue
from kvserve.services.scheduler.core.request import Request
from kvserve.shared.config import SchedulerConfig


class FcfsRequestQueue(DeadlineQueue):
    """Arrival order; preempted requests go back to the front (TTFT targets: DeadlineQueue).

    Args:
        aging_s: a request without a TTFT target is due this long after its arrival.
    """

    def __init__(self, aging_s: float = 5.0) -> None:
        super().__init__(aging_s)
        self._requests: deque[Request] = deque()

    def _add_untargeted(self, request: Request) -> None:
        self._requests.append(request)

    def _prepend_untargeted(self, request: Request) -> None:
        self._requests.appendleft(request)

    def _peek_untargeted(self) -> Request:
        return self._requests[0]

    def _pop_untargeted(self) -> Request:
        return self._requests.popleft()

    def _remove_untargeted(self, to_remove: set[int]) -> None:
        self._requests = deque(r for r in self._requests if id(r) not in to_remove)

    def _num_untargeted(self) -> int:
        return len(self._requests)

    def _iter_untargeted(self) -> Iterator[Request]:
        return iter(self._requests)


class FcfsPolicy(SchedulingPolicy):
    """Admitted in arrival order (earliest deadline first while TTFT targets wait:
    deadline_queue.py); the last admitted is preempted first.

    Args:
        scheduler_config: the scheduler's config.
    """

    name = "fcfs"

    def __init__(self, scheduler_config: SchedulerConfig) -> None:
        super().__init__(scheduler_config)
        self.waiting = FcfsRequestQueue(scheduler_config.slo_aging_ms / 1000)

    def pick_preemption_victim(self, running: list[Request]) -> Request:
        return running[-1]
