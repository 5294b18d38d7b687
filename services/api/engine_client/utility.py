"""UtilityCalls: RPCs that run in one engine core's busy loop, between two steps.

    call ─UTILITY (call_id, method)─▶ engine ─▶ UTILITY_OUTPUT (call_id, failure, result)
                                                 └─▶ resolve: the caller's future

Each call waits on a future keyed by its call id; the engine's death (or the client's)
fails the futures it leaves unanswered.
"""

from __future__ import annotations

import asyncio
import itertools

from kvserve.services.api.engine_client.client import EngineDeadError
from kvserve.services.api.engine_client.connection import EngineConnection
from kvserve.services.api.engine_client.pool import EnginePool
from kvserve.shared.wire import (
    EngineHeartbeat,
    EngineStats,
    GetStats,
    MsgType,
    Ping,
    ResetPrefixCache,
    Sleep,
    UtilityCall,
    UtilityMethod,
    UtilityOutput,
    UtilityResult,
    WakeUp,
)


class UtilityCalls:
    """
    Args:
        pool: the engines.
    """

    def __init__(self, pool: EnginePool):
        self.pool = pool
        self._call_ids = itertools.count()
        self.futures: dict[int, tuple[int, asyncio.Future]] = {}  # call id -> (engine, answer)

    async def call(
        self, method: UtilityMethod, timeout_s: float | None = None, engine_index: int | None = None
    ) -> UtilityResult:
        """Run a utility in one engine's busy loop and return its result.

        Args:
            engine_index: the engine (default: the lowest-index live one).

        Raises:
            RuntimeError: the utility failed in the engine (the engine lives on).
            EngineDeadError: the engine died before answering.
            TimeoutError: no answer within timeout_s.
        """
        engine = self._engine(engine_index)
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self.futures[call_id] = (engine.engine_index, future)
        try:
            await self.pool.send(engine, MsgType.UTILITY, UtilityCall(call_id, method))
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self.futures.pop(call_id, None)

    def _engine(self, engine_index: int | None) -> EngineConnection:
        closed_reason = self.pool.closed_reason()
        if closed_reason is not None:
            raise EngineDeadError(closed_reason)
        engines = self.pool.engines
        if engine_index is not None:
            if engine_index not in engines:
                raise ValueError(f"no engine core {engine_index}: engines are {sorted(engines)}")
            return engines[engine_index]
        return next(e for e in self.pool.sorted_engines() if e.is_alive)

    def resolve(self, output: UtilityOutput, now: float) -> None:
        """An engine answered a call (an answer is progress: its loop ran)."""
        engine_index, future = self.futures.pop(output.call_id, (None, None))
        if engine_index is not None:
            self.pool.engines[engine_index].on_message(now, progress=True)
        if future is None or future.done():
            return  # the caller timed out or went away
        if output.failure_message is not None:
            future.set_exception(RuntimeError(f"engine utility failed: {output.failure_message}"))
        else:
            future.set_result(output.result)

    def fail_engine(self, engine_index: int, reason: str) -> None:
        """The engine died: its unanswered calls fail with EngineDeadError(reason)."""
        for index, future in list(self.futures.values()):
            if index == engine_index and not future.done():
                future.set_exception(EngineDeadError(reason))

    def fail_all(self, reason: str) -> None:
        for _, future in self.futures.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        self.futures.clear()

    # ------------------------------------------------------------------ the utilities

    async def reset_prefix_cache(self) -> bool:
        """Reset every live engine's prefix cache; True when all of them did."""
        results = [
            await self.call(ResetPrefixCache(), engine_index=engine.engine_index)
            for engine in self.pool.sorted_engines()
            if engine.is_alive
        ]
        return all(results)

    def _live_indices(self) -> list[int]:
        return [e.engine_index for e in self.pool.sorted_engines() if e.is_alive]

    async def sleep(self, level: int) -> bool:
        """Put every live engine to sleep, all at once; True when all of them slept (one
        with requests in flight answers False and frees nothing)."""
        calls = [self.call(Sleep(level), engine_index=i) for i in self._live_indices()]
        return all(await asyncio.gather(*calls))

    async def wake_up(self, tags: list[str] | None) -> None:
        """Wake every live engine, all at once (each one's workers in parallel too)."""
        calls = [self.call(WakeUp(tags), engine_index=i) for i in self._live_indices()]
        await asyncio.gather(*calls)

    async def get_stats(self, engine_index: int | None = None) -> EngineStats:
        stats = await self.call(GetStats(), engine_index=engine_index)
        assert isinstance(stats, EngineStats), stats
        return stats

    async def ping(
        self, timeout_s: float | None = None, engine_index: int | None = None
    ) -> EngineHeartbeat:
        """Answered by the busy loop itself: proves it is not stuck."""
        heartbeat = await self.call(Ping(), timeout_s, engine_index)
        assert isinstance(heartbeat, EngineHeartbeat), heartbeat
        return heartbeat
