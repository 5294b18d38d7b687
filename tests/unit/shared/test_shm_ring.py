"""ShmRingBuffer: order, split messages, many readers in other processes, waits, cleanup."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import shared_memory

import pytest

from kvserve.shared.shm_ring import ShmRingBuffer, ShmRingHandle, ring_shm_name, unlink_rings_of
from tests.support import REPO_ROOT
from tests.support.waiting import wait_until


def _segment_exists(handle: ShmRingHandle) -> bool:
    return os.path.exists(f"/dev/shm/{handle.name}")


def _message(i: int, size: int) -> bytes:
    """Distinct, position-dependent bytes: a swapped or torn message cannot compare equal."""
    seed = hashlib.sha256(i.to_bytes(4, "little")).digest()
    return (seed * (size // len(seed) + 1))[:size]


def _sizes(num_messages: int, chunk_bytes: int) -> list[int]:
    # Empty, tiny, exactly one chunk, one byte over, and several chunks' worth.
    pattern = [0, 1, 7, chunk_bytes, chunk_bytes + 1, 3 * chunk_bytes + 5, 100]
    return [pattern[i % len(pattern)] for i in range(num_messages)]


@pytest.fixture
def ring():
    writer = ShmRingBuffer.create(num_readers=1, num_chunks=4, chunk_bytes=64)
    reader = ShmRingBuffer.attach(writer.handle, 0)
    yield writer, reader
    reader.close()
    writer.close()
    assert not _segment_exists(writer.handle)


def _read_all(reader: ShmRingBuffer, num_messages: int, out: list) -> None:
    for _ in range(num_messages):
        out.append(reader.dequeue(timeout=30))


def test_messages_arrive_in_order_with_split_ones(ring):
    writer, reader = ring
    sizes = _sizes(200, writer.handle.chunk_bytes)
    received: list[bytes] = []
    # A reader thread drains while the writer fills: 200 messages need ~2x as many chunks
    # as the 4-chunk ring holds, so the writer must wait for freed chunks many times.
    thread = threading.Thread(target=_read_all, args=(reader, len(sizes), received))
    thread.start()
    for i, size in enumerate(sizes):
        writer.enqueue(_message(i, size), timeout=30)
    thread.join(30)
    assert received == [_message(i, size) for i, size in enumerate(sizes)]


def test_message_larger_than_the_whole_ring(ring):
    writer, reader = ring
    big = _message(7, 20 * writer.handle.num_chunks * writer.handle.chunk_bytes + 3)
    received: list[bytes] = []
    thread = threading.Thread(target=_read_all, args=(reader, 2, received))
    thread.start()
    writer.enqueue(big, timeout=30)
    writer.enqueue(b"after", timeout=30)
    thread.join(30)
    assert received == [big, b"after"]


def test_writer_never_overwrites_an_unread_chunk():
    writer = ShmRingBuffer.create(num_readers=2, num_chunks=3, chunk_bytes=16)
    fast, slow = (ShmRingBuffer.attach(writer.handle, r) for r in range(2))
    try:
        for i in range(3):
            writer.enqueue(_message(i, 10))
            assert fast.dequeue(timeout=1) == _message(i, 10)
        # Every chunk is still unread by the slow reader: a fourth message must wait.
        with pytest.raises(TimeoutError):
            writer.enqueue(_message(3, 10), timeout=0.2)
        assert [slow.dequeue(timeout=1) for _ in range(3)] == [_message(i, 10) for i in range(3)]
        writer.enqueue(_message(3, 10), timeout=1)
        assert fast.dequeue(timeout=1) == slow.dequeue(timeout=1) == _message(3, 10)
    finally:
        fast.close()
        slow.close()
        writer.close()


def _reader_proc(handle: ShmRingHandle, rank: int, num_messages: int, conn) -> None:
    reader = ShmRingBuffer.attach(handle, rank)
    digest = hashlib.sha256()
    for _ in range(num_messages):
        message = reader.dequeue(timeout=60)
        digest.update(len(message).to_bytes(8, "little") + message)
    reader.close()
    conn.send(digest.hexdigest())


def test_every_reader_process_gets_every_message():
    num_readers, chunk_bytes = 3, 128
    writer = ShmRingBuffer.create(num_readers, num_chunks=4, chunk_bytes=chunk_bytes)
    sizes = _sizes(300, chunk_bytes)
    mp_ctx = multiprocessing.get_context("spawn")
    pipes = [mp_ctx.Pipe(duplex=False) for _ in range(num_readers)]
    procs = [
        mp_ctx.Process(target=_reader_proc, args=(writer.handle, r, len(sizes), send))
        for r, (_, send) in enumerate(pipes)
    ]
    try:
        for proc in procs:
            proc.start()
        expected = hashlib.sha256()
        for i, size in enumerate(sizes):
            message = _message(i, size)
            writer.enqueue(message, timeout=60)
            expected.update(len(message).to_bytes(8, "little") + message)
        for proc, (recv, _) in zip(procs, pipes):
            assert recv.poll(60), f"reader {proc.name} never finished"
            assert recv.recv() == expected.hexdigest()
            proc.join(10)
            assert proc.exitcode == 0
        # Readers exiting must not have unlinked the writer's segment.
        assert _segment_exists(writer.handle)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        writer.close()
    assert not _segment_exists(writer.handle)


def test_idle_reader_costs_almost_no_cpu():
    writer = ShmRingBuffer.create(num_readers=1, num_chunks=2, chunk_bytes=16)
    reader = ShmRingBuffer.attach(writer.handle, 0)
    cpu_seconds = []

    def wait_idle() -> None:
        start = time.thread_time()
        with pytest.raises(TimeoutError):
            reader.dequeue(timeout=1.0)
        cpu_seconds.append(time.thread_time() - start)

    try:
        thread = threading.Thread(target=wait_idle)
        thread.start()
        thread.join(10)
        # A reader that kept spinning would burn ~1 s of CPU here.
        assert cpu_seconds and cpu_seconds[0] < 0.15, cpu_seconds
    finally:
        reader.close()
        writer.close()


def test_check_alive_can_abort_a_wait(ring):
    _, reader = ring
    calls = []

    def writer_is_gone() -> None:
        calls.append(time.monotonic())
        raise RuntimeError("writer died")

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="writer died"):
        reader.dequeue(check_alive=writer_is_gone)
    assert len(calls) == 1 and time.monotonic() - start < 1.0


def test_attach_rejects_a_bad_reader_rank():
    writer = ShmRingBuffer.create(num_readers=2)
    try:
        with pytest.raises(ValueError, match="reader_rank 2"):
            ShmRingBuffer.attach(writer.handle, 2)
    finally:
        writer.close()
    with pytest.raises(ValueError, match="at least one reader"):
        ShmRingBuffer.create(num_readers=0)


def test_closing_twice_is_harmless_and_use_after_close_raises(ring):
    _, reader = ring
    reader.close()
    reader.close()
    with pytest.raises(RuntimeError, match="closed"):
        reader.dequeue(timeout=0.1)


_CRASHING_WRITER = """
import sys, time
from kvserve.shared.shm_ring import ShmRingBuffer
ring = ShmRingBuffer.create(num_readers=1)
print(ring.handle.name, flush=True)
time.sleep(60)
"""


def test_segment_of_a_killed_writer_is_cleaned_up():
    proc = subprocess.Popen(
        [sys.executable, "-c", _CRASHING_WRITER],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        name = proc.stdout.readline().strip()
        assert name and os.path.exists(f"/dev/shm/{name}")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        # The resource tracker outlives the writer and unlinks what it left behind.
        assert wait_until(lambda: not os.path.exists(f"/dev/shm/{name}"), timeout_s=10)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_rings_a_dead_process_left_are_unlinked_by_its_pid():
    """A killed writer's ring is found by the pid in its name (what the launcher does when it
    restarts or stops an engine core); another process's ring is left alone."""
    mine = ShmRingBuffer.create(num_readers=1, num_chunks=2, chunk_bytes=64)
    assert mine.handle.name.startswith(ring_shm_name(os.getpid()).rsplit("-", 1)[0] + "-")
    dead_pid = 2**22 + 7  # above any pid_max default: no live process has it
    left = shared_memory.SharedMemory(ring_shm_name(dead_pid), create=True, size=64)
    left.close()
    try:
        assert unlink_rings_of(dead_pid) == [left.name]
        assert not os.path.exists("/dev/shm/" + left.name)
        assert _segment_exists(mine.handle)  # not the dead pid's: untouched
        assert unlink_rings_of(dead_pid) == []
    finally:
        mine.close()
    assert not _segment_exists(mine.handle)
