"""LoadTableFeed: the DP coordinator's load tables into the router, and what routing does
without them.

The coordinator publishes every engine core's (waiting, running) at least every KEEPALIVE_S
(services/coordinator/coordinator.py). A coordinator that died is restarted by the launcher
on the same address (the SUB socket reconnects by itself); one that hangs (stopped, starved)
is not. Either way, routing must not lean on the last table it sent, which only ever grows
between tables (DPRouter counts each request it sends until the next one). So once no table
came for COORDINATOR_LOST_S, the coordinator is *lost*: the feed logs it once, /health shows
it, and each routing decision first refreshes the router from the api's own view of each
engine (the requests it sent there and not seen end). The
next table ends that, and says so in the log.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import msgspec
import zmq
import zmq.asyncio

from kvserve.services.api.engine_client.dp_router import DPRouter
from kvserve.services.api.engine_client.pool import EnginePool
from kvserve.shared.logging import init_logger
from kvserve.shared.transport import make_socket
from kvserve.shared.wire import EngineLoad, LoadTable

logger = init_logger(__name__)

# Three keepalives missed (the coordinator's KEEPALIVE_S is 1): it is gone or hung.
COORDINATOR_LOST_S = 3.0


class LoadTableFeed:
    """
    Args:
        pool: the engines, whose own counts stand in for a lost coordinator's.
        router: takes each table (or the api's own view).
        address: the coordinator's PUB address.
        on_table: called with each table's loads once the router has them (the fair
            policy's tenant counters).
    """

    def __init__(
        self,
        pool: EnginePool,
        router: DPRouter,
        address: str,
        on_table: Callable[[list[EngineLoad]], Awaitable[None]],
    ):
        self.pool = pool
        self.router = router
        self.address = address
        self._on_table = on_table
        self.last_table_at = time.monotonic()  # the start counts as one: a grace period
        self.lost = False

    async def receive(self) -> None:
        """Feed the tables to the router (a task, until cancelled); mark the coordinator
        lost after COORDINATOR_LOST_S without one."""
        socket = make_socket(self.pool.channel.ctx, self.address, zmq.SUB, bind=False)
        decoder = msgspec.msgpack.Decoder(LoadTable)
        try:
            while True:
                if not await socket.poll(COORDINATOR_LOST_S * 1000):  # POLLIN
                    self._mark_lost()
                    continue
                try:
                    table = decoder.decode(await socket.recv())
                except msgspec.DecodeError as exc:
                    logger.error("dropped a malformed load table: %s", exc)
                    continue
                self._mark_back()
                self.router.update_loads(table.loads)
                await self._on_table(table.loads)
        finally:
            socket.close()

    def refresh(self) -> None:
        """Before a routing decision: with the coordinator lost, the router takes the api's
        own view of each live engine."""
        if self.lost:
            self.router.update_loads(self._own_loads())

    def describe(self) -> dict:
        """/health's "coordinator" entry."""
        return {
            "address": self.address,
            "state": "lost" if self.lost else "serving",
            "last_table_s": round(time.monotonic() - self.last_table_at, 1),
        }

    def _own_loads(self) -> list[EngineLoad]:
        """Each live engine's requests sent and not seen to end (the api's exact count),
        split into running and waiting by its latest step stats (which may lag)."""
        loads = []
        for engine in self.pool.engines.values():
            if not engine.is_alive:
                continue
            num_in_flight = self.pool.num_in_flight[engine.engine_index]
            stats = engine.latest_stats
            num_running = min(num_in_flight, stats.num_running_reqs if stats is not None else 0)
            loads.append(EngineLoad(engine.engine_index, num_in_flight - num_running, num_running))
        return loads

    def _mark_lost(self) -> None:
        if self.lost:
            return
        self.lost = True
        logger.error(
            "no load table from the DP coordinator (%s) for %.1f s: it is gone or hung; "
            "routing on the api's own counts of each engine core's requests until it is back",
            self.address,
            time.monotonic() - self.last_table_at,
        )

    def _mark_back(self) -> None:
        now = time.monotonic()
        if self.lost:
            self.lost = False
            logger.info(
                "the DP coordinator's load tables are back after %.1f s; routing on them again",
                now - self.last_table_at,
            )
        self.last_table_at = now
