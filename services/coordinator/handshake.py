"""The headless handshake: engines on other nodes register with the front-end node.

    headless node (ranks R..R+L-1)                front-end node (`kvserve serve`)
    DEALER ── EngineRegistration ──────────────▶  ROUTER tcp://HOST:RPC_PORT (bind)
           ◀─ EngineAssignment (api input/output, coordinator stats addresses) ─┘
    then each engine core connects to those addresses and says READY as a local one does.

The front end serves once all N engines are READY, and answers registrations for as long as
it runs: a node that restarts (or one whose engines the front end dropped) registers again,
and the api readmits its engines when they say READY.
"""

from __future__ import annotations

import threading
import time

import msgspec
import zmq
import zmq.asyncio

from kvserve.shared.logging import init_logger
from kvserve.shared.transport import make_socket
from kvserve.shared.wire import EngineAssignment, EngineRegistration

logger = init_logger(__name__)

_POLL_MS = 200


def rpc_address(host: str, port: int) -> str:
    """The handshake socket of the front-end node (--data-parallel-address, -rpc-port)."""
    return f"tcp://{host}:{port}"


class RegistrationServer:
    """The front end's side: hands each headless node the addresses its engines connect to.

    Args:
        rpc_addr: where to bind (tcp://HOST:PORT).
        remote_engine_indices: the DP ranks the other nodes must run.
        assignment: what every registered node receives.
    """

    def __init__(
        self, rpc_addr: str, remote_engine_indices: set[int], assignment: EngineAssignment
    ):
        self.ctx = zmq.asyncio.Context()
        self.socket = make_socket(self.ctx, rpc_addr, zmq.ROUTER, bind=True)
        self.rpc_addr = rpc_addr
        self.remote_indices = frozenset(remote_engine_indices)
        self.pending_indices = set(remote_engine_indices)
        self.assignment = assignment
        self._decoder = msgspec.msgpack.Decoder(EngineRegistration)

    async def serve(self) -> None:
        """Answer registrations until cancelled."""
        logger.info(
            "waiting on %s for headless engines %s", self.rpc_addr, sorted(self.pending_indices)
        )
        try:
            while True:
                peer, payload = await self.socket.recv_multipart()
                reply = self._answer(payload)
                await self.socket.send_multipart([peer, msgspec.msgpack.encode(reply)])
        finally:
            self.close()

    def _answer(self, payload: bytes) -> EngineAssignment:
        try:
            registration = self._decoder.decode(payload)
        except msgspec.DecodeError as exc:
            logger.error("dropped a malformed registration: %s", exc)
            return EngineAssignment(error=f"malformed registration: {exc}")
        unexpected = set(registration.engine_indices) - self.remote_indices
        if unexpected or not registration.engine_indices:
            error = (
                f"engine ranks {sorted(unexpected)} are not expected here (other nodes run "
                f"{sorted(self.remote_indices)}): check --data-parallel-start-rank and "
                f"--data-parallel-size-local of node {registration.hostname}"
            )
            logger.error("refused a registration: %s", error)
            return EngineAssignment(error=error)
        again = not set(registration.engine_indices) <= self.pending_indices
        self.pending_indices -= set(registration.engine_indices)
        logger.info(
            "headless node %s registered engines %s%s",
            registration.hostname,
            registration.engine_indices,
            " again (they replace the ones running now)" if again else "",
        )
        return self.assignment

    def close(self) -> None:
        self.ctx.destroy(linger=1000)  # lets the last answer out


def register_engines(
    rpc_addr: str,
    registration: EngineRegistration,
    timeout_s: float,
    stop: threading.Event | None = None,
) -> EngineAssignment | None:
    """The headless node's side: register, and return the addresses to connect to (None when
    `stop` was set first).

    Raises:
        TimeoutError: the front end did not answer within timeout_s.
        ValueError: the front end refused the ranks.
    """
    ctx = zmq.Context()
    try:
        sock = make_socket(ctx, rpc_addr, zmq.DEALER, bind=False)
        sock.send(msgspec.msgpack.encode(registration))
        logger.info(
            "registering engines %s with the front end at %s", registration.engine_indices, rpc_addr
        )
        deadline = time.monotonic() + timeout_s
        # Short polls, so a SIGTERM (which sets `stop`) is noticed.
        while not sock.poll(_POLL_MS):
            if stop is not None and stop.is_set():
                return None
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no answer from the front-end node at {rpc_addr} within {timeout_s:.0f} "
                    f"s: is `kvserve serve --data-parallel-address ... "
                    f"--data-parallel-rpc-port ...` running there, with the same "
                    f"--transport-keys as this node?"
                )
        assignment = msgspec.msgpack.decode(sock.recv(), type=EngineAssignment)
    finally:
        ctx.destroy(linger=0)
    if assignment.error is not None:
        raise ValueError(
            f"the front-end node refused engines {registration.engine_indices}: {assignment.error}"
        )
    return assignment
