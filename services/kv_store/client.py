"""KvStoreClient: what an engine's KV connector calls to save and load blocks of its paged cache.

    client = KvStoreClient("ipc:///tmp/kv", fingerprint, timeout_s=2.0)
    num_held = client.lookup(block_hashes)                     # longest held prefix, in blocks
    stored = client.put(block_hashes, kv_caches, block_ids)    # cache -> store
    loaded = client.get(block_hashes, kv_caches, block_ids)    # store -> cache (held prefix)

Transport: "arena" maps the store's slots (shared memory, or CUDA IPC for a --device cuda
store) and copies straight between them and the cache, one control message per batch;
"frames" sends the bytes as zero-copy ZMQ frames (tcp:// across hosts). "auto" picks the
arena for ipc:// addresses.

Every call waits at most `timeout_s` per round trip; a store that does not answer raises
KvStoreUnavailable (the engine recomputes instead), and the next call connects afresh, so a
restarted store serves again. Not thread-safe: one client per thread.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import msgspec
import torch
import zmq

from kvserve.services.kv_store.arena import CudaArena, HostArena
from kvserve.services.kv_store.blocks import (
    check_kv_caches,
    copy_blocks_to_slots,
    copy_slots_to_blocks,
    slots_view,
)
from kvserve.shared.messages import (
    KvCommit,
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
    KvStoreReply,
    KvStoreStats,
)
from kvserve.shared.transport import make_socket

Transport = Literal["auto", "arena", "frames"]


class KvStoreUnavailable(RuntimeError):
    """The store did not answer in time (dead, killed, unreachable) or refused the call."""


class KvPinned(msgspec.Struct, frozen=True):
    """A pin on the held prefix of some hashes; end it with KvStoreClient.unpin."""

    lease_id: int
    num_blocks: int


class KvStoreClient:
    """One connection to a store, for one layout.

    Args:
        address: the store's ipc:// or tcp:// address.
        fingerprint: the layout of the caches this client copies (one TP rank's).
        timeout_s: how long one round trip to the store may take.
        transport: "auto", "arena" or "frames" (see the module).
        connect: connect now (KvStoreUnavailable if the store is down); else on first call.
    """

    def __init__(
        self,
        address: str,
        fingerprint: KvFingerprint,
        timeout_s: float = 2.0,
        transport: Transport = "auto",
        connect: bool = True,
    ):
        self.address = address
        self.fingerprint = fingerprint
        self.timeout_s = timeout_s
        self.use_arena = transport == "arena" or (
            transport == "auto" and address.startswith("ipc://")
        )
        self.dtype = getattr(torch, fingerprint.dtype)
        self._ctx: zmq.Context = zmq.Context.instance()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(KvStoreReply)
        self._call_ids = itertools.count(1)
        self._sock: zmq.Socket | None = None
        self._pool_id = b""
        self._arena: HostArena | None = None
        self._view: torch.Tensor | None = None  # the arena as [num_slots, layers, 2, E]
        self._staging: torch.Tensor | None = None  # frames put: the blocks, back to back
        if connect:
            self.connect()

    # ------------------------------------------------------------------------ public API

    def connect(self) -> None:
        """Say hello (and map the arena); KvStoreUnavailable if the store does not answer."""
        if self._sock is None:
            self._sock = make_socket(self._ctx, self.address, zmq.DEALER, bind=False)
        reply, _ = self._round_trip(KvHello(next(self._call_ids), self.fingerprint))
        assert isinstance(reply, KvHelloReply)
        self._pool_id = reply.pool_id
        if self.use_arena:
            self._map_arena(reply)

    def lookup(self, block_hashes: Sequence[bytes]) -> int:
        """Blocks of `block_hashes`, from the first, that the store holds."""
        if not block_hashes:
            return 0
        reply, _ = self._pool_call(lambda c, p: KvLookup(c, p, list(block_hashes)))
        return reply.num_blocks

    def put(
        self,
        block_hashes: Sequence[bytes],
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[int],
    ) -> int:
        """Copy blocks block_ids[i] of the paged caches into the store under block_hashes[i].

        Returns how many blocks of the chain, from the first, the store holds now: fewer
        than asked when it found no room (a full store never errors, never blocks).
        """
        self._check_batch(block_hashes, kv_caches, block_ids)
        if not block_hashes:
            return 0
        hashes = list(block_hashes)
        if not self.use_arena:
            staging = self._staging_for(len(hashes))
            copy_blocks_to_slots(kv_caches, block_ids, staging, range(len(hashes)))
            frame = staging.view(torch.uint8).numpy()
            reply, _ = self._pool_call(lambda c, p: KvPut(c, p, hashes), frames=[frame])
            return reply.num_blocks
        lease, _ = self._pool_call(lambda c, p: KvReserve(c, p, hashes))
        assert isinstance(lease, KvLease)
        if not lease.slots:
            return 0
        writes = [(i, slot) for i, slot in enumerate(lease.slots) if slot >= 0]
        try:
            assert self._view is not None
            copy_blocks_to_slots(
                kv_caches, [block_ids[i] for i, _ in writes], self._view, [s for _, s in writes]
            )
        except BaseException:
            self._send_release(lease.lease_id)
            raise
        reply, _ = self._round_trip(KvCommit(next(self._call_ids), lease.lease_id))
        return reply.num_blocks

    def get(
        self,
        block_hashes: Sequence[bytes],
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[int],
    ) -> int:
        """Copy the held prefix of `block_hashes` into blocks block_ids[:n] of the caches.

        Returns n, the blocks loaded (0 when the first is not held); blocks past n are left
        as they were.
        """
        self._check_batch(block_hashes, kv_caches, block_ids)
        if not block_hashes:
            return 0
        hashes = list(block_hashes)
        if not self.use_arena:
            reply, frames = self._pool_call(lambda c, p: KvGet(c, p, hashes, as_frames=True))
            return self._load_frames(frames, kv_caches, block_ids, reply.num_blocks)
        lease, _ = self._pool_call(lambda c, p: KvGet(c, p, hashes))
        assert isinstance(lease, KvLease)
        if not lease.slots:
            return 0
        try:
            assert self._view is not None
            num = len(lease.slots)
            copy_slots_to_blocks(self._view, lease.slots, kv_caches, block_ids[:num])
        finally:
            self._send_release(lease.lease_id)
        return len(lease.slots)

    def pin(self, block_hashes: Sequence[bytes], ttl_s: float | None = None) -> KvPinned:
        """Keep the held prefix of `block_hashes` from eviction until unpin (or `ttl_s`, the
        store's --lease-timeout-s when None), e.g. between a lookup and the get."""
        reply, _ = self._pool_call(lambda c, p: KvPin(c, p, list(block_hashes), ttl_s))
        assert isinstance(reply, KvLease)
        return KvPinned(reply.lease_id, len(reply.slots))

    def unpin(self, pinned: KvPinned) -> None:
        if pinned.lease_id:
            self._send_release(pinned.lease_id)

    def stats(self) -> KvStoreStats:
        reply, _ = self._round_trip(KvStatsQuery(next(self._call_ids)))
        assert isinstance(reply, KvStatsReply)
        return reply.stats

    def shutdown_store(self) -> None:
        """Ask the store to stop (it answers first)."""
        self._round_trip(KvShutdown(next(self._call_ids)))

    def close(self) -> None:
        self._disconnect()

    def __enter__(self) -> KvStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------ internals

    def _pool_call(
        self, make: Callable[[int, bytes], Any], frames: Sequence[Any] = ()
    ) -> tuple[Any, list[zmq.Frame]]:
        """A call on this client's pool; on UNKNOWN_POOL (the store restarted) say hello again
        and retry once, so a stale pool id never reaches a new arena."""
        if self._sock is None:
            self.connect()
        try:
            return self._round_trip(make(next(self._call_ids), self._pool_id), frames)
        except _UnknownPool:
            self._unmap_arena()
            self.connect()
            return self._round_trip(make(next(self._call_ids), self._pool_id), frames)

    def _round_trip(self, request: Any, frames: Sequence[Any] = ()) -> tuple[Any, list[zmq.Frame]]:
        if self._sock is None:
            self._sock = make_socket(self._ctx, self.address, zmq.DEALER, bind=False)
        sock = self._sock
        kind = type(request).__name__
        try:
            sock.send_multipart([self._encoder.encode(request), *frames], copy=False)
            deadline_ms = int(self.timeout_s * 1000)
            while True:
                # A reply to an earlier call that timed out may arrive first: skip it.
                if not sock.poll(deadline_ms, zmq.POLLIN):
                    raise KvStoreUnavailable(
                        f"KV store at {self.address} did not answer {kind} within "
                        f"{self.timeout_s} s"
                    )
                reply_frames = sock.recv_multipart(copy=False)
                reply = self._decoder.decode(reply_frames[0].buffer)
                if reply.call_id == request.call_id:
                    break
        except KvStoreUnavailable:
            self._disconnect()
            raise
        except zmq.ZMQError as exc:
            self._disconnect()
            raise KvStoreUnavailable(f"KV store at {self.address}: {exc}") from exc
        if isinstance(reply, KvError):
            if reply.code == KvErrorCode.UNKNOWN_POOL:
                raise _UnknownPool(reply.message)
            raise ValueError(f"KV store refused {kind}: {reply.message}")
        return reply, reply_frames[1:]

    def _send_release(self, lease_id: int) -> None:
        if self._sock is not None:
            with_no_reply = self._encoder.encode(KvRelease(lease_id))
            try:
                self._sock.send(with_no_reply, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the lease expires on its own

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._unmap_arena()

    def _map_arena(self, hello: KvHelloReply) -> None:
        if hello.cuda_arena is not None:
            slots = CudaArena.attach(hello.cuda_arena)
            self._view = slots.view(self.dtype).view(
                -1,
                self.fingerprint.num_layers,
                self.fingerprint.num_planes,
                self.fingerprint.block_elements,
            )
            return
        if hello.host_arena is None:
            raise KvStoreUnavailable(f"KV store at {self.address} exports no arena")
        if self._arena is not None and self._arena.handle == hello.host_arena:
            return
        self._unmap_arena()
        self._arena = HostArena.attach(hello.host_arena)
        self._view = slots_view(self._arena.buffer, self.fingerprint, self.dtype)

    def _unmap_arena(self) -> None:
        self._view = None  # the tensor view goes before the mapping it holds
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    def _staging_for(self, num_blocks: int) -> torch.Tensor:
        fp = self.fingerprint
        if self._staging is None or self._staging.shape[0] < num_blocks:
            self._staging = torch.empty(
                num_blocks, fp.num_layers, fp.num_planes, fp.block_elements, dtype=self.dtype
            )
        return self._staging[:num_blocks]

    def _load_frames(
        self,
        frames: list[zmq.Frame],
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        num_blocks: int,
    ) -> int:
        position = 0
        for frame in frames:
            with warnings.catch_warnings():  # received frames are read-only; we only read
                warnings.simplefilter("ignore", UserWarning)
                run = slots_view(frame.buffer, self.fingerprint, self.dtype)
            ids = block_ids[position : position + len(run)]
            copy_slots_to_blocks(run, range(len(run)), kv_caches, ids)
            position += len(run)
        assert position == num_blocks, "frames do not add up to the blocks the store sent"
        return num_blocks

    def _check_batch(
        self,
        block_hashes: Sequence[bytes],
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[int],
    ) -> None:
        if len(block_hashes) != len(block_ids):
            raise ValueError(f"{len(block_hashes)} block hashes for {len(block_ids)} block ids")
        check_kv_caches(kv_caches, self.fingerprint)


class _UnknownPool(Exception):
    pass
