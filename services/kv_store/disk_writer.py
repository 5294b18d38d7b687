"""The disk tier's writer: one thread that does every file mutation, in the order asked.

The store's loop never waits on a write: it queues a job and goes on. Writes, expiry
refreshes and deletes of one file all pass through this one FIFO thread, so they can never
overtake each other (a delete queued after a write removes what the write made). A finished
write is reported back through `take_done()`, and a byte on a pipe wakes the loop's poll.

A block is written to a temporary name in its folder, then renamed: a reader (or a restarted
store) sees the whole file or none. fsync policy: a pinned block (the retention promise) is
fsynced before the rename and its folder after; a spilled block is not (a crash that loses it
loses a cache entry, and its checksum catches a torn one).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from typing import Any, NamedTuple

from kvserve.services.kv_store.disk_format import (
    EXPIRY_OFFSET,
    HEADER_BYTES,
    TMP_SUFFIX,
    header_crc_bytes,
    pack_expiry,
    pack_header,
    unpack_header,
)
from kvserve.shared.logging import init_logger

logger = init_logger(__name__)


class WriteJob(NamedTuple):
    token: int  # handed back by take_done
    path: str
    fp_key: bytes
    block_hash: bytes
    payload: Any  # a buffer; the store keeps it unchanged until the job is done
    expires_at: float
    durable: bool  # fsync file and folder


class ExpiryJob(NamedTuple):
    path: str
    expires_at: float


class DeleteJob(NamedTuple):
    path: str


class DiskWriter:
    """The thread and its queue.

    Args:
        name: the thread's name (for logs).
    """

    def __init__(self, name: str = "kv-disk-writer"):
        self._jobs: queue.Queue[WriteJob | ExpiryJob | DeleteJob | None] = queue.Queue()
        self._done: list[tuple[int, bool]] = []
        self._lock = threading.Lock()
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: WriteJob | ExpiryJob | DeleteJob) -> None:
        self._jobs.put(job)

    def take_done(self) -> list[tuple[int, bool]]:
        """(token, ok) of the writes finished since the last call; empties the wake pipe."""
        with contextlib.suppress(BlockingIOError):
            os.read(self.wake_fd, 4096)
        with self._lock:
            done, self._done = self._done, []
        return done

    def wait_idle(self) -> None:
        """Block until every queued job is done (tests, shutdown)."""
        self._jobs.join()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish the queued jobs (up to `timeout_s`) and stop the thread; take_done() still
        reports them."""
        if not self._thread.is_alive():
            return
        self._jobs.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("KV disk tier: writes still queued after %.0f s, abandoned", timeout_s)

    def close(self) -> None:
        """Stop, then close the wake pipe."""
        self.stop()
        os.close(self.wake_fd)
        os.close(self._wake_w)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                self._do(job)
            except Exception:  # an expiry or delete that failed oddly: the thread goes on
                logger.exception("KV disk tier: %s failed", type(job).__name__)
            finally:
                self._jobs.task_done()

    def _do(self, job: WriteJob | ExpiryJob | DeleteJob) -> None:
        if isinstance(job, DeleteJob):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(job.path)
            return
        if isinstance(job, ExpiryJob):
            self._rewrite_expiry(job)
            return
        ok = False
        try:
            ok = self._write(job)
        except Exception:  # never lose a report: the store holds the block until it comes
            logger.exception("KV disk tier: writing %s failed", job.path)
        with self._lock:
            self._done.append((job.token, ok))
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"w")

    def _write(self, job: WriteJob) -> bool:
        tmp = job.path + TMP_SUFFIX
        try:
            os.makedirs(os.path.dirname(job.path), exist_ok=True)
            # The checksum is computed here, off the store's loop.
            header = pack_header(job.fp_key, job.block_hash, job.payload, job.expires_at)
            with open(tmp, "wb") as f:  # buffered: write() writes it all or raises
                f.write(header)
                f.write(job.payload)
                f.flush()
                if job.durable:
                    os.fsync(f.fileno())
            os.replace(tmp, job.path)
            if job.durable:
                _fsync_dir(os.path.dirname(job.path))
            return True
        except OSError as exc:
            logger.warning("KV disk tier: writing %s failed (%s)", job.path, exc)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return False

    def _rewrite_expiry(self, job: ExpiryJob) -> None:
        try:
            fd = os.open(job.path, os.O_RDWR)
        except FileNotFoundError:
            return  # deleted meanwhile
        try:
            header = os.pread(fd, HEADER_BYTES, 0)
            if unpack_header(header) is None:
                return  # torn or foreign: the next read or scan drops it
            expiry = pack_expiry(header_crc_bytes(header), job.expires_at)
            os.pwrite(fd, expiry, EXPIRY_OFFSET)
            os.fsync(fd)
        except OSError as exc:
            logger.warning("KV disk tier: refreshing the pin of %s failed (%s)", job.path, exc)
        finally:
            os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
