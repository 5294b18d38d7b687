"""Earliest deadline first over a policy's waiting queue: how TTFT targets order admission.

A request with a TTFT target is due at `arrival_time + slo_ttft_ms`; one without is due at
`arrival_time + slo_aging_ms` (SchedulerConfig), its aging bound. Waiting requests are
admitted by due time, so targeted requests go before untargeted ones until those have
waited their aging bound, and no request starves behind a stream of targeted ones. Under
`priority` the priority ranks first, then the due time; under `fair` the tenant is picked by
fairness and the due time orders requests inside it (FairRequestQueue's key).

With no targeted request waiting, a DeadlineQueue is exactly the policy's own queue (the
fcfs and priority queues are DeadlineQueues).
"""

from __future__ import annotations

import heapq
import itertools
from abc import abstractmethod
from collections.abc import Iterable, Iterator

from kvserve.services.scheduler.core.request import Request
from kvserve.services.scheduler.core.request_queue import RequestQueue


def due_time(request: Request, aging_s: float) -> float:
    """When `request` should be admitted at the latest (the arrival_time clock)."""
    if request.slo_ttft_ms is not None:
        return request.arrival_time + request.slo_ttft_ms / 1000
    return request.arrival_time + aging_s


class DeadlineQueue(RequestQueue):
    """Targeted requests in a heap by (priority, due time); the others in the policy's own
    order, kept by the subclass (the `_*_untargeted` methods). The head is whichever of the
    two heads ranks first (see the module doc).

    Args:
        aging_s: the aging bound (SchedulerConfig.slo_aging_ms, in seconds).
        by_priority: rank by priority before the due time (the priority policy).
    """

    def __init__(self, aging_s: float = 5.0, by_priority: bool = False) -> None:
        self.aging_s = aging_s
        self.by_priority = by_priority
        self._targeted: list[tuple[tuple[int, float], int, Request]] = []
        self._targeted_seq = itertools.count()

    # The untargeted requests, in the policy's order.

    @abstractmethod
    def _add_untargeted(self, request: Request) -> None: ...

    @abstractmethod
    def _prepend_untargeted(self, request: Request) -> None: ...

    @abstractmethod
    def _peek_untargeted(self) -> Request: ...

    @abstractmethod
    def _pop_untargeted(self) -> Request: ...

    @abstractmethod
    def _remove_untargeted(self, to_remove: set[int]) -> None:
        """Drop the requests whose id() is in `to_remove`."""

    @abstractmethod
    def _num_untargeted(self) -> int: ...

    @abstractmethod
    def _iter_untargeted(self) -> Iterator[Request]: ...

    # The queue.

    def rank(self, request: Request) -> tuple[int, float]:
        return (request.priority if self.by_priority else 0, due_time(request, self.aging_s))

    def add_request(self, request: Request) -> None:
        if request.slo_ttft_ms is None:
            self._add_untargeted(request)
        else:
            entry = (self.rank(request), next(self._targeted_seq), request)
            heapq.heappush(self._targeted, entry)

    def prepend_request(self, request: Request) -> None:
        # A preempted targeted request keeps its due time (long past: it goes first).
        if request.slo_ttft_ms is None:
            self._prepend_untargeted(request)
        else:
            self.add_request(request)

    def _targeted_first(self) -> bool:
        if not self._targeted:
            return False
        if not self._num_untargeted():
            return True
        return self._targeted[0][0] <= self.rank(self._peek_untargeted())

    def peek_request(self) -> Request:
        return self._targeted[0][-1] if self._targeted_first() else self._peek_untargeted()

    def pop_request(self) -> Request:
        if self._targeted_first():
            return heapq.heappop(self._targeted)[-1]
        return self._pop_untargeted()

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = {id(request) for request in requests}
        self._remove_untargeted(to_remove)
        if self._targeted:
            self._targeted = [entry for entry in self._targeted if id(entry[-1]) not in to_remove]
            heapq.heapify(self._targeted)

    def __len__(self) -> int:
        return self._num_untargeted() + len(self._targeted)

    def __iter__(self) -> Iterator[Request]:
        """The two orders merged as pop would take them."""
        if not self._targeted:
            yield from self._iter_untargeted()
            return
        targeted = [entry[-1] for entry in sorted(self._targeted)]
        untargeted = list(self._iter_untargeted())
        i = j = 0
        while i < len(targeted) and j < len(untargeted):
            if self.rank(targeted[i]) <= self.rank(untargeted[j]):
                yield targeted[i]
                i += 1
            else:
                yield untargeted[j]
                j += 1
        yield from targeted[i:]
        yield from untargeted[j:]
