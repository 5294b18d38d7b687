"""--scheduling-policy priority: the lowest priority value first, then the earliest arrival."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from kvserve.services.scheduler.core.policies.base import SchedulingPolicy
from kvserve.services.scheduler.core.policies.deadline_queue import DeadlineQueue
from kvserve.services.scheduler.core.request import Request
from kvserve.shared.config import SchedulerConfig


class PriorityRequestQueue(DeadlineQueue):
    """Lowest (priority, arrival_time) first, as a binary heap (TTFT targets: DeadlineQueue,
    by priority, then due time).

    A preempted request keeps its key, so it goes back ahead of everything that arrived after
    it at its priority; a sequence number breaks exact ties without comparing Requests.

    Args:
        aging_s: a request without a TTFT target is due this long after its arrival.
    """

    def __init__(self, aging_s: float = 5.0) -> None:
        super().__init__(aging_s, by_priority=True)
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def _add_untargeted(self, request: Request) -> None:
        heapq.heappush(
            self._heap, (request.priority, request.arrival_time, next(self._seq), request)
        )

    def _prepend_untargeted(self, request: Request) -> None:
        self._add_untargeted(request)

    def _peek_untargeted(self) -> Request:
        return self._heap[0][-1]

    def _pop_untargeted(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def _remove_untargeted(self, to_remove: set[int]) -> None:
        self._heap = [entry for entry in self._heap if id(entry[-1]) not in to_remove]
        heapq.heapify(self._heap)

    def _num_untargeted(self) -> int:
        return len(self._heap)

    def _iter_untargeted(self) -> Iterator[Request]:
        return (entry[-1] for entry in sorted(self._heap))


class PriorityPolicy(SchedulingPolicy):
    """Admitted by (priority, arrival_time) (by (priority, deadline) while TTFT targets
    wait: deadline_queue.py); the least important running request, then the latest, is
    preempted first.

    Args:
        scheduler_config: the scheduler's config.
    """

    name = "priority"

    def __init__(self, scheduler_config: SchedulerConfig) -> None:
        super().__init__(scheduler_config)
        self.waiting = PriorityRequestQueue(scheduler_config.slo_aging_ms / 1000)

    def pick_preemption_victim(self, running: list[Request]) -> Request:
        # Largest (priority, arrival_time): least important, then latest; on exact ties
        # the last admitted (max keeps the first maximum it meets).
        return max(reversed(running), key=lambda r: (r.priority, r.arrival_time))
