"""The waiting queue's interface; each scheduling policy has its own (policies/)."""

from __future__ import annotations

from abc import ABC, abstractmethod
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
