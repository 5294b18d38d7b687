"""Shared-memory broadcast ring: one writer, N readers, per-chunk flags.

The engine core writes each SchedulerOutput once and every worker rank reads it from the same
shared memory: one copy in, one copy out per rank, no socket and no syscall on the hot path.

The segment holds `num_chunks` chunks, each a small header of one-byte flags and a payload:

    chunk i:  | written | more | read[0] ... read[R-1] | pad | num_bytes (u64) | payload |
              '------------------ header: header_bytes -----------------------'

    written   1 once the writer has filled the chunk; 0 while it is being (re)written
    more      1 when the message goes on in the next chunk
    read[r]   1 once reader r has copied the chunk out

A chunk is free for the writer when it was never written or every reader has read it; it is
ready for reader r when it is written and read[r] is still 0. The writer and every reader walk
the chunks in the same cyclic order, so each reader gets every message, in order, once.

Messages larger than a chunk are split over consecutive chunks (the `more` flag) rather than
sent over a ZMQ PUB/SUB fallback: one transport keeps ordering trivial and needs no
subscription handshake (PUB drops what it sends before a SUB has joined). A message longer
than the whole ring still goes through: the writer simply waits for readers to drain chunks.

Waiting: a waiter yields the CPU in a tight loop for `spin_s` (a step's message arrives within
a millisecond or two of the previous answer), then sleeps in doubling steps up to
`max_sleep_s`, so an idle ring costs a few hundred wake-ups a second and ~no CPU.
"""

from __future__ import annotations

import _posixshmem  # CPython's own POSIX shm module, what SharedMemory is built on
import functools
import mmap
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable
from multiprocessing import shared_memory

import msgspec

from kvserve.shared.shm_segments import unlink_segments

_WRITTEN, _MORE, _READ_FLAGS = 0, 1, 2
_LENGTH = struct.Struct("<Q")
_CACHE_LINE = 64
_fence_lock = threading.Lock()
RING_SHM_PREFIX = "kvserve-ring-"  # then the creator's pid: see unlink_rings_of


def _memory_fence() -> None:
    # Python has no atomics; a lock round trip executes atomic instructions with full
    # barriers, which keeps payload and flag stores ordered on weakly ordered CPUs (ARM).
    with _fence_lock:
        pass


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def ring_shm_name(pid: int) -> str:
    """A new ring segment's name: the creator's pid, so that whoever restarts a killed
    creator can find (and unlink) what it left, and a random part for several rings."""
    return f"{RING_SHM_PREFIX}{pid}-{secrets.token_hex(4)}"


def unlink_rings_of(pid: int) -> list[str]:
    """Unlink the ring segments that process `pid`, now dead, created; their names.

    A SIGKILLed writer never unlinks its ring (8 MiB by default), and the tracker it
    registered it with only does at the launcher's exit: one would pile up per death.

    Args:
        pid: the dead process (never a live one: its ring would vanish under it).
    """
    return unlink_segments(f"{RING_SHM_PREFIX}{pid}-*")


class ShmRingHandle(msgspec.Struct, frozen=True):
    """What another process needs to attach to a ring (send it as JSON or msgpack)."""

    name: str  # the shared-memory segment, as SharedMemory names it (no leading slash)
    num_readers: int
    num_chunks: int
    chunk_bytes: int  # payload bytes per chunk

    @property
    def header_bytes(self) -> int:
        return _round_up(_READ_FLAGS + self.num_readers, 8) + _LENGTH.size

    @property
    def chunk_stride(self) -> int:
        # Chunks start on cache lines so two chunks' flags never share one.
        return _round_up(self.header_bytes + self.chunk_bytes, _CACHE_LINE)

    @property
    def total_bytes(self) -> int:
        return self.num_chunks * self.chunk_stride


class ShmRingBuffer:
    """One side of a broadcast ring: the writer (which owns the segment) or reader `rank`.

    Build it with `ShmRingBuffer.create(...)` (writer) or `ShmRingBuffer.attach(handle,
    reader_rank)` (reader), never directly.

    Args:
        handle: the ring's geometry and segment name.
        buf: the mapped segment.
        reader_rank: None for the writer, else this reader's index in [0, num_readers).
        closer: releases the mapping (and, for the writer, unlinks the segment).
        spin_s: how long a waiter yields in a tight loop before it starts sleeping.
        max_sleep_s: the longest sleep between two looks at the flags.
    """

    def __init__(
        self,
        handle: ShmRingHandle,
        buf: memoryview,
        reader_rank: int | None,
        closer: Callable[[], None],
        spin_s: float = 1e-3,
        max_sleep_s: float = 2e-3,
    ):
        assert len(buf) >= handle.total_bytes, "segment smaller than the ring it holds"
        self.handle = handle
        self.reader_rank = reader_rank
        self.spin_s = spin_s
        self.max_sleep_s = max_sleep_s
        self._buf = buf
        self._closer: Callable[[], None] | None = closer  # None once closed
        self._index = 0  # next chunk to write (writer) or read (reader)
        self._all_read = b"\x01" * handle.num_readers
        self._broken = False

    # ------------------------------------------------------------------ construction

    @classmethod
    def create(
        cls, num_readers: int, num_chunks: int = 8, chunk_bytes: int = 1 << 20, **wait_knobs
    ) -> ShmRingBuffer:
        """Create a new segment and return its writer side (which unlinks it on close).

        Args:
            num_readers: readers that must read each message before its chunk is reused.
            num_chunks: chunks in the ring (messages in flight at most).
            chunk_bytes: payload bytes per chunk; longer messages span several chunks.
            **wait_knobs: spin_s / max_sleep_s, see the class.
        """
        if num_readers < 1 or num_chunks < 1 or chunk_bytes < 1:
            raise ValueError(
                f"a ring needs at least one reader, chunk and byte per chunk; got "
                f"num_readers={num_readers}, num_chunks={num_chunks}, "
                f"chunk_bytes={chunk_bytes}"
            )
        geometry = ShmRingHandle("", num_readers, num_chunks, chunk_bytes)
        # The segment is registered with the resource tracker, so it is unlinked even if
        # this process dies without closing the ring. A new segment is all zeros: every
        # chunk starts out free (never written).
        shm = shared_memory.SharedMemory(
            ring_shm_name(os.getpid()), create=True, size=geometry.total_bytes
        )
        handle = ShmRingHandle(shm.name, num_readers, num_chunks, chunk_bytes)

        def close_and_unlink() -> None:
            shm.close()
            try:
                shm.unlink()
            except FileNotFoundError:
                pass  # already gone (the resource tracker or a crash cleaner beat us)

        buf = shm.buf
        assert buf is not None, "a newly created segment is mapped"
        return cls(handle, buf, None, close_and_unlink, **wait_knobs)

    @classmethod
    def attach(cls, handle: ShmRingHandle, reader_rank: int, **wait_knobs) -> ShmRingBuffer:
        """Map an existing ring as reader `reader_rank`.

        Args:
            handle: the writer's `handle`.
            reader_rank: this reader's index in [0, handle.num_readers).
            **wait_knobs: spin_s / max_sleep_s, see the class.
        """
        if not 0 <= reader_rank < handle.num_readers:
            raise ValueError(f"reader_rank {reader_rank} is outside [0, {handle.num_readers})")
        # Not SharedMemory(name): before Python 3.13 it registers the segment with this
        # process's resource tracker, which would unlink the writer's segment when this
        # reader exits (CPython gh-82300). A reader maps it and leaves its lifetime alone.
        fd = _posixshmem.shm_open("/" + handle.name, os.O_RDWR, mode=0o600)
        try:
            mapping = mmap.mmap(fd, handle.total_bytes)
        finally:
            os.close(fd)
        buf = memoryview(mapping)

        def close() -> None:
            buf.release()
            mapping.close()

        return cls(handle, buf, reader_rank, close, **wait_knobs)

    def close(self) -> None:
        """Unmap the ring; the writer also unlinks the segment. Safe to call twice."""
        if self._closer is not None:
            closer, self._closer = self._closer, None
            closer()

    # ------------------------------------------------------------------ writer

    def enqueue(
        self,
        payload: bytes | bytearray | memoryview,
        timeout: float | None = None,
        check_alive: Callable[[], None] | None = None,
    ) -> None:
        """Write one message for every reader (writer only).

        Args:
            payload: the message bytes; any length (long ones span several chunks).
            timeout: seconds to wait for free chunks in all; TimeoutError after that.
            check_alive: called about every 0.1 s while waiting; raise in it to give up
                (say, when a reader process has died).
        """
        assert self.reader_rank is None, "only the writer enqueues"
        self._check_usable()
        view = memoryview(payload).cast("B")
        deadline = None if timeout is None else time.monotonic() + timeout
        chunk_bytes = self.handle.chunk_bytes
        start = 0
        while True:
            piece = view[start : start + chunk_bytes]
            partial = start > 0  # earlier pieces of this message are already out
            start += len(piece)
            more = start < len(view)
            offset = self._chunk_offset(self._index)
            self._wait(functools.partial(self._is_free, offset), deadline, check_alive, partial)
            self._write_chunk(offset, piece, more)
            self._index = (self._index + 1) % self.handle.num_chunks
            if not more:
                return

    def _is_free(self, offset: int) -> bool:
        buf = self._buf
        if buf[offset + _WRITTEN] == 0:
            return True
        flags = offset + _READ_FLAGS
        return buf[flags : flags + self.handle.num_readers] == self._all_read

    def _write_chunk(self, offset: int, piece: memoryview, more: bool) -> None:
        buf, header = self._buf, self.handle.header_bytes
        # Readers see written == 0 while the payload changes, and the read flags are only
        # cleared once the payload is complete: no reader can see half a message.
        buf[offset + _WRITTEN] = 0
        _memory_fence()
        buf[offset + header : offset + header + len(piece)] = piece
        _LENGTH.pack_into(buf, offset + header - _LENGTH.size, len(piece))
        buf[offset + _MORE] = int(more)
        flags = offset + _READ_FLAGS
        buf[flags : flags + self.handle.num_readers] = bytes(self.handle.num_readers)
        _memory_fence()
        buf[offset + _WRITTEN] = 1

    # ------------------------------------------------------------------ reader

    def dequeue(
        self, timeout: float | None = None, check_alive: Callable[[], None] | None = None
    ) -> bytes:
        """Read the next message (reader only), waiting for it if need be.

        Args:
            timeout: seconds to wait in all; TimeoutError after that.
            check_alive: called about every 0.1 s while waiting; raise in it to give up
                (say, when the writer's process has died).
        """
        assert self.reader_rank is not None, "only readers dequeue"
        self._check_usable()
        deadline = None if timeout is None else time.monotonic() + timeout
        my_flag = _READ_FLAGS + self.reader_rank
        header = self.handle.header_bytes
        pieces: list[bytes] = []
        while True:
            offset = self._chunk_offset(self._index)
            self._wait(
                functools.partial(self._is_ready, offset, my_flag),
                deadline,
                check_alive,
                partial=bool(pieces),
            )
            buf = self._buf
            _memory_fence()
            (num_bytes,) = _LENGTH.unpack_from(buf, offset + header - _LENGTH.size)
            pieces.append(bytes(buf[offset + header : offset + header + num_bytes]))
            more = buf[offset + _MORE] == 1
            # The copy must be complete before the writer may reuse the chunk.
            _memory_fence()
            buf[offset + my_flag] = 1
            self._index = (self._index + 1) % self.handle.num_chunks
            if not more:
                return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def _is_ready(self, offset: int, my_flag: int) -> bool:
        return self._buf[offset + _WRITTEN] == 1 and self._buf[offset + my_flag] == 0

    # ------------------------------------------------------------------ helpers

    def _chunk_offset(self, index: int) -> int:
        return index * self.handle.chunk_stride

    def _check_usable(self) -> None:
        if self._closer is None:
            raise RuntimeError("the shared-memory ring is closed")
        if self._broken:
            raise RuntimeError(
                "the shared-memory ring gave up in the middle of a message and "
                "is out of step with its peers; build a new one"
            )

    def _wait(
        self,
        ready: Callable[[], bool],
        deadline: float | None,
        check_alive: Callable[[], None] | None,
        partial: bool,
    ) -> None:
        """Spin, then back off, until ready(); mid-message give-ups break the ring."""
        start = time.monotonic()
        next_check = start + 0.1
        sleep_s = min(50e-6, self.max_sleep_s)
        try:
            while not ready():
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise TimeoutError(
                        "the shared-memory ring timed out waiting for "
                        + (
                            "readers to free a chunk"
                            if self.reader_rank is None
                            else "the writer's next message"
                        )
                    )
                if check_alive is not None and now >= next_check:
                    check_alive()
                    next_check = now + 0.1
                if now - start < self.spin_s:
                    os.sched_yield()
                else:
                    time.sleep(sleep_s)
                    sleep_s = min(2 * sleep_s, self.max_sleep_s)
        except BaseException:
            # Half a message written or read leaves this side out of step with the others.
            self._broken = self._broken or partial
            raise
