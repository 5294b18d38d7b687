"""Poll a condition until it holds: from a plain thread, or from inside an event loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_until(
    predicate: Callable[[], object], timeout_s: float = 20.0, interval_s: float = 0.05
) -> bool:
    """Poll predicate() until it is true; False on timeout (checked once more at the end).

    Callers assert the result, with a message saying what never happened.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


async def wait_until_async(
    predicate: Callable[[], object], timeout_s: float, interval_s: float = 0.02
) -> float:
    """Seconds until predicate() held, polled without blocking the running event loop;
    fails the test (AssertionError) after timeout_s."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, "condition not reached in time"
        await asyncio.sleep(interval_s)
    return time.monotonic() - start
