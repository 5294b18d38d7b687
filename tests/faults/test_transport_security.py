"""CURVE on tcp:// sockets against real peers: what a peer without the deployment's key sends
is dropped (the server receives nothing), and the server serves keyed peers on.

The strangers are raw zmq sockets, as an attacker's would be: plain tcp, CURVE with a keypair
of their own that pins our server key (refused by the ZAP handler), and another deployment's
keys (the handshake fails).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvserve.services.coordinator.coordinator import start_coordinator_process
from kvserve.shared import transport_security
from kvserve.shared.env import TRANSPORT_KEYS
from kvserve.shared.transport import CoordinatorAddresses, bound_address, make_socket
from kvserve.shared.transport_security import TransportKeys, generate_keys, load_keys
from kvserve.shared.wire import EngineLoad, LoadTable

# How long a stranger's message is given to (not) arrive; loopback delivers in microseconds.
DROP_WAIT_MS = 1000


@pytest.fixture
def keys(tmp_path, monkeypatch) -> TransportKeys:
    """A fresh deployment keypair for this test's sockets and the processes it starts."""
    folder = str(tmp_path / "keys")
    generate_keys(folder)
    monkeypatch.setenv(TRANSPORT_KEYS.name, folder)
    return load_keys(folder)


def _stranger(
    ctx: zmq.Context, kind: int, address: str, curve: tuple[bytes, bytes, bytes] | None = None
) -> zmq.Socket:
    """A peer that is not one of ours: plain, or CURVE with (public, secret, server key)."""
    sock = ctx.socket(kind)
    sock.linger = 0
    if kind == zmq.SUB:
        sock.subscribe(b"")
    if curve is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = curve
    sock.connect(address)
    return sock


def _send_if_possible(sock: zmq.Socket, payload: bytes) -> None:
    """A stranger's send: once libzmq dropped its connection there is no peer to queue for,
    and a blocking send would wait forever."""
    with contextlib.suppress(zmq.Again):
        sock.send(payload, zmq.NOBLOCK)


def _strangers(ctx: zmq.Context, kind: int, address: str, keys: TransportKeys) -> list[zmq.Socket]:
    own_public, own_secret = zmq.curve_keypair()
    other_public, other_secret = zmq.curve_keypair()
    return [
        _stranger(ctx, kind, address),
        _stranger(ctx, kind, address, (own_public, own_secret, keys.public_key)),
        _stranger(ctx, kind, address, (other_public, other_secret, other_public)),
    ]


def test_strangers_are_dropped_and_keyed_peers_served(keys):
    ctx = zmq.Context()
    try:
        router = make_socket(ctx, "tcp://127.0.0.1:*", zmq.ROUTER, bind=True)
        address = bound_address(router)
        strangers = _strangers(ctx, zmq.DEALER, address, keys)
        for i, sock in enumerate(strangers):
            _send_if_possible(sock, f"stranger {i}".encode())
        assert not router.poll(DROP_WAIT_MS), router.recv_multipart()

        dealer = make_socket(ctx, address, zmq.DEALER, bind=False, identity=b"ours")
        dealer.send(b"hello")
        assert router.poll(5000)
        assert router.recv_multipart() == [b"ours", b"hello"]
        router.send_multipart([b"ours", b"back"])
        assert dealer.poll(5000) and dealer.recv() == b"back"

        for sock in strangers:  # still nothing, and nothing of before arrives late
            _send_if_possible(sock, b"again")
        assert not router.poll(DROP_WAIT_MS), router.recv_multipart()
    finally:
        ctx.destroy(linger=0)


def test_a_keyed_client_gets_nothing_from_a_server_with_other_keys(keys, tmp_path, monkeypatch):
    ctx = zmq.Context()
    try:
        pull = make_socket(ctx, "tcp://127.0.0.1:*", zmq.PULL, bind=True)
        other = str(tmp_path / "other")
        generate_keys(other)
        monkeypatch.setenv(TRANSPORT_KEYS.name, other)  # a node of another deployment
        push = make_socket(ctx, bound_address(pull), zmq.PUSH, bind=False)
        push.send(b"misdirected")
        assert not pull.poll(DROP_WAIT_MS)
    finally:
        ctx.destroy(linger=0)


def test_the_zap_handler_of_an_asyncio_context_ends_with_it(keys):
    sync_ctx = zmq.Context()

    async def serve_once() -> tuple[bytes, threading.Thread]:
        ctx = zmq.asyncio.Context()
        pull = make_socket(ctx, "tcp://127.0.0.1:*", zmq.PULL, bind=True)
        make_socket(ctx, "tcp://127.0.0.1:*", zmq.PUB, bind=True)  # the same handler serves it
        handler = transport_security._zap_handlers[ctx]
        push = make_socket(sync_ctx, bound_address(pull), zmq.PUSH, bind=False)
        push.send(b"async")
        received = await asyncio.wait_for(pull.recv(), 5)
        push.close()
        ctx.destroy(linger=0)  # wakes the handler with ETERM; returns once it closed its socket
        return received, handler

    try:
        received, handler = asyncio.run(serve_once())
    finally:
        sync_ctx.destroy(linger=0)
    assert received == b"async"
    handler.join(5)
    assert not handler.is_alive()

    ctx = zmq.Context()  # a plain context's term(), once its sockets are closed, ends it too
    make_socket(ctx, "tcp://127.0.0.1:*", zmq.PULL, bind=True).close()
    handler = transport_security._zap_handlers[ctx]
    terminator = threading.Thread(target=ctx.term, daemon=True)
    terminator.start()
    terminator.join(5)
    assert not terminator.is_alive(), "term() hung on the ZAP handler's socket"
    handler.join(5)
    assert not handler.is_alive()


def test_the_coordinator_process_drops_loads_and_subscribers_without_the_key(keys):
    process, addresses = start_coordinator_process(CoordinatorAddresses.tcp("127.0.0.1"))
    ctx = zmq.Context()
    try:
        sub = make_socket(ctx, addresses.publish_addr, zmq.SUB, bind=False)
        push = make_socket(ctx, addresses.stats_addr, zmq.PUSH, bind=False)
        rogue_pushes = _strangers(ctx, zmq.PUSH, addresses.stats_addr, keys)
        rogue_subs = _strangers(ctx, zmq.SUB, addresses.publish_addr, keys)
        decoder = msgspec.msgpack.Decoder(LoadTable)
        ours, theirs = EngineLoad(0, 1, 2), EngineLoad(7, 9, 9)
        seen: list[list[EngineLoad]] = []
        deadline = time.monotonic() + 20
        # Until our load has been in the table for a second (several publications).
        while sum(ours in loads for loads in seen) < 5 or seen[-1] == []:
            assert time.monotonic() < deadline, f"the table never showed our load: {seen}"
            push.send(msgspec.msgpack.encode(ours))
            for rogue in rogue_pushes:
                _send_if_possible(rogue, msgspec.msgpack.encode(theirs))
            if sub.poll(200):
                seen.append(decoder.decode(sub.recv()).loads)
        assert not any(theirs in loads for loads in seen), seen
        assert not any(rogue.poll(0) for rogue in rogue_subs), "a stranger got the table"
        assert process.is_alive()
    finally:
        ctx.destroy(linger=0)
        process.terminate()
        process.join(10)
    assert process.exitcode == 0
