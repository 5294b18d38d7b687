"""`kvserve kv-store`: the store process. One thread, one ROUTER per address, a blocking poll.

    client DEALER ──[KvStoreRequest, *data]──▶ ROUTER (bind each --address)
                 ◀──[KvStoreReply, *data]───

Same host (ipc://): a put is KvReserve → the client copies into the leased arena slots →
KvCommit; a get is KvGet → slots, pinned under a lease → the client copies → KvRelease. No
block bytes cross the socket. Across hosts (tcp://): KvPut carries the blocks as one data
frame, and a KvGet with `as_frames` is answered with zero-copy frames of arena runs, whose
lease ends when zmq has sent them (its MessageTracker).

The poll sleeps until a message, a signal (a self-pipe: SIGTERM/SIGINT stop the loop), or
the next lease deadline: an idle store with no leases never wakes. This process never imports
torch unless --device cuda.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import msgspec
import numpy as np
import zmq

from kvserve.services.kv_store.arena import CudaArena, HostArena, arena_shm_name, slot_runs
from kvserve.services.kv_store.disk_tier import DiskTier
from kvserve.services.kv_store.store import KvBlockStore, Pool
from kvserve.shared.launch_options import KvStoreOptions
from kvserve.shared.logging import init_logger
from kvserve.shared.messages import (
    KvCommit,
    KvCount,
    KvError,
    KvErrorCode,
    KvFingerprint,
    KvGet,
    KvHello,
    KvHelloReply,
    KvLease,
    KvLookup,
    KvPin,
    KvPut,
    KvRelease,
    KvReserve,
    KvShutdown,
    KvStatsQuery,
    KvStatsReply,
    KvStoreRequest,
)
from kvserve.shared.transport import make_socket, remove_ipc_file

logger = init_logger(__name__)

# While zero-copy frames are in flight the loop looks at their trackers this often.
_TRACKER_POLL_MS = 5


class _Reply(NamedTuple):
    message: Any
    frames: Sequence[Any] = ()
    lease_id: int | None = None  # released once the frames are sent


class _Refused(Exception):
    def __init__(self, code: KvErrorCode, message: str):
        super().__init__(message)
        self.code = code


class KvStoreServer:
    """The store's sockets and loop around a KvBlockStore.

    Args:
        options: addresses, --size, lease timeout, device.
    """

    def __init__(self, options: KvStoreOptions):
        self.options = options
        self.disk = _open_disk_tier(options)
        self.store = KvBlockStore(
            options.size, options.lease_timeout_s, self._make_arena, disk=self.disk
        )
        self._ctx = zmq.Context()
        self._sockets = [
            make_socket(self._ctx, addr, zmq.ROUTER, bind=True) for addr in options.addresses
        ]
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(KvStoreRequest)
        self._in_flight: list[tuple[zmq.MessageTracker, int]] = []
        self._stopping = False
        self._handlers: dict[type, Callable[[Any, list[zmq.Frame]], _Reply | None]] = {
            KvHello: self._hello,
            KvLookup: self._lookup,
            KvReserve: self._reserve,
            KvCommit: lambda r, _: _Reply(KvCount(r.call_id, self.store.commit(r.lease_id))),
            KvPut: self._put,
            KvGet: self._get,
            KvPin: self._pin,
            KvRelease: self._release,
            KvStatsQuery: lambda r, _: _Reply(KvStatsReply(r.call_id, self.store.stats())),
            KvShutdown: self._shutdown,
        }

    # ------------------------------------------------------------------------ loop

    def run(self) -> None:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        old_wakeup_fd = signal.set_wakeup_fd(wake_w)
        old_handlers = {
            s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)
        }
        poller = zmq.Poller()
        for sock in self._sockets:
            poller.register(sock, zmq.POLLIN)
        poller.register(wake_r, zmq.POLLIN)
        if self.disk is not None:
            poller.register(self.disk.wake_fd, zmq.POLLIN)
        logger.info(
            "KV store on %s: %.1f MiB, leases last %.1f s, device %s (pid %d)",
            ", ".join(self.options.addresses),
            self.options.size / 2**20,
            self.options.lease_timeout_s,
            self.options.device,
            os.getpid(),
        )
        shm = os.statvfs("/dev/shm")
        if self.options.device == "cpu" and shm.f_bavail * shm.f_frsize < self.options.size:
            logger.warning(
                "KV store: /dev/shm has %.1f MiB free, less than --size: a put past it "
                "would crash the store (SIGBUS); lower --size or grow /dev/shm",
                shm.f_bavail * shm.f_frsize / 2**20,
            )
        try:
            while not self._stopping:
                events = dict(poller.poll(self._poll_timeout_ms()))
                if wake_r in events:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_r, 4096)
                if self.disk is not None and self.disk.wake_fd in events:
                    self.store.finish_disk_writes()
                # Reap first: a client that got its frames may already be asking for stats.
                self._reap()
                for sock in self._sockets:
                    if sock in events:
                        self._drain(sock)
        finally:
            signal.set_wakeup_fd(old_wakeup_fd)
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
            os.close(wake_r)
            os.close(wake_w)
            self.close()

    def close(self) -> None:
        """Close the sockets (after up to 1 s for queued replies), unlink the arenas."""
        for sock in self._sockets:
            sock.close(linger=1000)
        self._ctx.term()
        self._in_flight.clear()
        self.store.close()
        for addr in self.options.addresses:
            remove_ipc_file(addr)
        logger.info("KV store stopped")

    def _on_signal(self, signum: int, frame: Any) -> None:
        logger.info("KV store: %s, stopping", signal.Signals(signum).name)
        self._stopping = True

    def _poll_timeout_ms(self) -> int | None:
        if self._in_flight:
            return _TRACKER_POLL_MS
        now = time.monotonic()
        deadline = self.store.next_deadline(now)
        if deadline is None:
            return None  # idle: block until a message or a signal
        return max(0, int((deadline - now) * 1000) + 1)

    def _reap(self) -> None:
        if self._in_flight:
            sent = [(t, lease_id) for t, lease_id in self._in_flight if t.done]
            self._in_flight = [(t, lease_id) for t, lease_id in self._in_flight if not t.done]
            for _, lease_id in sent:
                self.store.release(lease_id)
        for lease in self.store.expire(time.monotonic()):
            logger.info(
                "KV store: lease %d (%s, %d blocks) expired unreleased: reclaimed",
                lease.lease_id,
                "reservation" if lease.writes else "pin",
                len(lease.blocks),
            )

    def _drain(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) < 2:
                logger.warning("KV store: dropped a message of %d frames", len(frames))
                continue
            self._handle(sock, frames[0].bytes, frames[1], frames[2:])

    def _handle(
        self, sock: zmq.Socket, identity: bytes, payload: zmq.Frame, data: list[zmq.Frame]
    ) -> None:
        try:
            request = self._decoder.decode(payload.buffer)
        except msgspec.DecodeError as exc:
            logger.warning("KV store: dropped an undecodable request (%s)", exc)
            return
        try:
            reply = self._handlers[type(request)](request, data)
        except _Refused as exc:
            assert not isinstance(request, KvRelease)  # a release never fails (it has no reply)
            reply = _Reply(KvError(request.call_id, exc.code, str(exc)))
        except ValueError as exc:
            assert not isinstance(request, KvRelease)
            reply = _Reply(KvError(request.call_id, KvErrorCode.BAD_REQUEST, str(exc)))
        if reply is not None:
            self._send(sock, identity, reply)

    def _send(self, sock: zmq.Socket, identity: bytes, reply: _Reply) -> None:
        frames = [identity, self._encoder.encode(reply.message), *reply.frames]
        try:
            if reply.lease_id is None:
                sock.send_multipart(frames, copy=False)
                return
            tracker = sock.send_multipart(frames, copy=False, track=True)
            assert tracker is not None  # track=True returns one
            self._in_flight.append((tracker, reply.lease_id))
        except zmq.ZMQError as exc:  # the client is gone (ROUTER_MANDATORY)
            logger.debug("KV store: reply to a gone client dropped (%s)", exc)
            if reply.lease_id is not None:
                self.store.release(reply.lease_id)

    # ------------------------------------------------------------------------ handlers

    def _make_arena(self, fingerprint: KvFingerprint, pool_id: bytes, num_slots: int) -> Any:
        if self.options.device == "cuda":
            arena: Any = CudaArena(0, num_slots, fingerprint.block_bytes)
        else:
            name = arena_shm_name(self.options.addresses[0], pool_id)
            arena = HostArena.create(name, num_slots, fingerprint.block_bytes)
        logger.info(
            "KV store: new pool %s for %s (%s, %d layers, %d KV heads x %d, block %d, TP rank "
            "%d): %d slots of %d KiB",
            pool_id.hex(),
            fingerprint.model,
            fingerprint.dtype,
            fingerprint.num_layers,
            fingerprint.num_kv_heads,
            fingerprint.head_size,
            fingerprint.block_size,
            fingerprint.tp_rank,
            num_slots,
            fingerprint.block_bytes // 1024,
        )
        return arena

    def _pool(self, pool_id: bytes) -> Pool:
        pool = self.store.pools.get(pool_id)
        if pool is None:
            raise _Refused(KvErrorCode.UNKNOWN_POOL, "unknown pool (did the store restart?)")
        return pool

    def _hello(self, request: KvHello, data: list[zmq.Frame]) -> _Reply:
        pool = self.store.open_pool(request.fingerprint)
        arena = pool.arena
        return _Reply(
            KvHelloReply(
                request.call_id,
                pool.pool_id,
                self.store.capacity_bytes,
                host_arena=arena.handle if isinstance(arena, HostArena) else None,
                cuda_arena=arena.handle if isinstance(arena, CudaArena) else None,
            )
        )

    def _lookup(self, request: KvLookup, data: list[zmq.Frame]) -> _Reply:
        pool = self._pool(request.pool_id)
        return _Reply(KvCount(request.call_id, self.store.lookup(pool, request.block_hashes)))

    def _reserve(self, request: KvReserve, data: list[zmq.Frame]) -> _Reply:
        pool = self._pool(request.pool_id)
        lease, slots = self.store.reserve(pool, request.block_hashes, time.monotonic())
        if not slots:
            self.store.release(lease.lease_id)
        return _Reply(KvLease(request.call_id, lease.lease_id if slots else 0, slots))

    def _put(self, request: KvPut, data: list[zmq.Frame]) -> _Reply:
        pool = self._pool(request.pool_id)
        expected = len(request.block_hashes) * pool.block_bytes
        if len(data) != 1 or len(data[0].buffer) != expected:
            sizes = [len(frame.buffer) for frame in data]
            raise ValueError(
                f"a put of {len(request.block_hashes)} blocks needs one frame of "
                f"{expected} bytes, got frames of {sizes}"
            )
        blocks = np.frombuffer(data[0].buffer, dtype=np.uint8).reshape(-1, pool.block_bytes)
        lease, slots = self.store.reserve(pool, request.block_hashes, time.monotonic())
        positions = np.flatnonzero(np.asarray(slots, dtype=np.int64) >= 0)
        new_slots = [slots[i] for i in positions]
        for start, first_slot, length in slot_runs(new_slots):
            rows = positions[start : start + length]
            if rows[-1] - rows[0] + 1 == length:
                pool.arena.write_run(first_slot, blocks[rows[0] : rows[-1] + 1])
            else:
                pool.arena.write_run(first_slot, blocks[rows])
        return _Reply(KvCount(request.call_id, self.store.commit(lease.lease_id)))

    def _get(self, request: KvGet, data: list[zmq.Frame]) -> _Reply:
        pool = self._pool(request.pool_id)
        lease = self.store.acquire(pool, request.block_hashes, time.monotonic())
        slots = [block.slot for block in lease.blocks]
        if not slots:
            self.store.release(lease.lease_id)
            if request.as_frames:
                return _Reply(KvCount(request.call_id, 0))
            return _Reply(KvLease(request.call_id, 0, []))
        if not request.as_frames:
            return _Reply(KvLease(request.call_id, lease.lease_id, slots))
        frames = [pool.arena.read_run(first, length) for _, first, length in slot_runs(slots)]
        return _Reply(KvCount(request.call_id, len(slots)), frames, lease.lease_id)

    def _pin(self, request: KvPin, data: list[zmq.Frame]) -> _Reply:
        pool = self._pool(request.pool_id)
        now = time.monotonic()
        lease = self.store.acquire(pool, request.block_hashes, now, request.ttl_s, reading=False)
        slots = [block.slot for block in lease.blocks]
        if not slots:
            self.store.release(lease.lease_id)
        return _Reply(KvLease(request.call_id, lease.lease_id if slots else 0, slots))

    def _release(self, request: KvRelease, data: list[zmq.Frame]) -> None:
        self.store.release(request.lease_id)
        return None

    def _shutdown(self, request: KvShutdown, data: list[zmq.Frame]) -> _Reply:
        logger.info("KV store: shutdown requested")
        self._stopping = True
        return _Reply(KvCount(request.call_id, 0))


def _open_disk_tier(options: KvStoreOptions) -> DiskTier | None:
    """The disk tier of --disk-path, its index rebuilt from the files, or None."""
    if options.disk_path is None:
        return None
    try:
        disk = DiskTier(options.disk_path, options.disk_bytes)
    except OSError as exc:
        raise ValueError(f"--disk-path {options.disk_path}: {exc}") from None
    disk.scan()
    return disk


def run_kv_store(options: KvStoreOptions) -> int:
    """The `kvserve kv-store` command: serve until SIGTERM, SIGINT or a KvShutdown."""
    try:
        server = KvStoreServer(options)
    except ValueError as exc:  # a disk tier it cannot use
        logger.error("KV store: %s", exc)
        return 1
    server.run()
    return 0
