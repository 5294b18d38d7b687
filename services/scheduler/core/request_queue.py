"""The waiting queue: first come first served, or by priority."""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from kvserve.services.scheduler.core.request import Request


class RequestQueue(ABC):
    """Requests waiting to be scheduled; the head is the next one to admit."""

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a newly arrived request."""

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """Queue a preempted request so it runs again before requests that arrived later."""

    @abstractmethod
    def peek_request(self) -> Request:
        """The head, left in place; IndexError when empty."""

    @abstractmethod
    def pop_request(self) -> Request:
        """Remove and return the head; IndexError when empty."""

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None:
        """Drop the given requests (aborts); O(n), as aborts are rare."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """The requests in admission order."""

    def __bool__(self) -> bool:
        return len(self) > 0


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


def create_request_queue(policy: str) -> RequestQueue:
    """The waiting queue for a `--scheduling-policy` ("fcfs" or "priority"; "fair" has
    fair_share.FairRequestQueue, over the scheduler's tenant counters)."""
    if policy == "fcfs":
        return FcfsRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}; use 'fcfs' or 'priority'")
