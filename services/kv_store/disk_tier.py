"""The store's disk tier (--disk-path DIR --disk-bytes N): block files under the memory tier.

    memory tier (arena slots) ──evicted, not on disk──▶ spill (a copy, written by a thread)
                              ──pinned with a TTL─────▶ written at pin time (from the slot)
    get / pin of a hash held only here ◀── read, verified, promoted into a slot

Bookkeeping only runs on the store's loop; every file mutation runs on the DiskWriter thread
(services/kv_store/disk_writer.py), in order. Reads (promotion on get or pin) run on the loop,
one block at a time: they are bounded by the blocks a call names.

- A block is one file (services/kv_store/disk_format.py); the index maps fingerprint key +
  block hash to it. One file per block: a rename makes each one atomic, eviction is an
  unlink (no segment compaction), a bad file costs one block, and blocks are big (a
  SmolLM2-135M block is 720 KiB) so the per-file cost is small.
- Pinned blocks (expires_at > 0) are never evicted before their expiry; at expiry their file
  is deleted (the TTL is the retention promise). Unpinned blocks sit in one LRU order; a
  block that does not fit evicts the oldest unpinned ones, and finds no room when only
  pinned ones are left.
- A block whose write is still queued is in the index (its bytes count against the budget),
  but is neither readable nor evictable until the writer reports it done.
- At start-up the index is rebuilt from the files' headers (the payload's checksum is checked
  when it is read): a restarted store serves what it had, and an expired, torn or foreign
  file is deleted.
"""

from __future__ import annotations

import contextlib
import fcntl
import heapq
import itertools
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve.services.kv_store.disk_format import (
    HEADER_BYTES,
    MAX_HASH_BYTES,
    SUFFIX,
    TMP_SUFFIX,
    block_path,
    read_block,
    unpack_header,
)
from kvserve.services.kv_store.disk_writer import DeleteJob, DiskWriter, ExpiryJob, WriteJob
from kvserve.shared.logging import init_logger

logger = init_logger(__name__)

# Spills copy the evicted slot; at most this many bytes of copies wait for the writer, so a
# slow disk drops spills instead of growing the store's memory.
MAX_PENDING_SPILL_BYTES = 256 * 2**20
# A pin refresh rewrites the file's expiry only when it moves by more than this (or a tenth
# of the TTL, when less): agents refresh every turn, and only a restart reads the file's.
EXPIRY_SLACK_S = 60.0


@dataclass(slots=True, eq=False)
class DiskBlock:
    key: bytes  # fingerprint key (16 bytes) + block hash
    path: str
    nbytes: int  # the file's size
    expires_at: float  # wall-clock seconds; 0.0: not pinned
    file_expires_at: float = 0.0  # what the file says (a refresh may lag, by the slack)
    token: int = 0  # the pending write's token; 0 once written
    spill_bytes: int = 0  # of a pending spill, counted in pending_spill_bytes

    @property
    def ready(self) -> bool:
        return self.token == 0


class DiskTier:
    """Index, budget and expiry of the block files under `root`.

    Args:
        root: the folder (created if missing); one store process at a time (a lock file).
        capacity_bytes: the budget of all files together (headers included).
        clock: wall-clock seconds (time.time), for expiries that outlive the process.
    """

    def __init__(self, root: str, capacity_bytes: int, clock: Callable[[], float] = time.time):
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.clock = clock
        os.makedirs(root, exist_ok=True)
        self._lock_fd = _lock_folder(root)
        self.writer = DiskWriter()
        self.blocks: dict[bytes, DiskBlock] = {}
        self._lru: OrderedDict[bytes, DiskBlock] = OrderedDict()  # ready, unpinned; oldest first
        self._expiries: list[tuple[float, bytes]] = []  # heap of (expires_at, key)
        self._tokens = itertools.count(1)
        self._by_token: dict[int, DiskBlock] = {}  # pending writes
        self.used_bytes = self.pending_spill_bytes = 0
        self.hits = self.spills = self.checksum_failures = self.expirations = 0
        self.dropped = 0  # spills or pin writes that found no room
        self.writes = 0  # block files the writer finished (spills and pins)
        self.evictions = 0  # unpinned blocks deleted to make room

    @property
    def wake_fd(self) -> int:
        """Readable when writes finished: the loop then calls the store's finish_disk_writes."""
        return self.writer.wake_fd

    # ------------------------------------------------------------------------ queries

    def holds(self, fp_key: bytes, block_hash: bytes) -> bool:
        """Whether a written, unexpired file holds the block (no I/O)."""
        block = self.blocks.get(fp_key + block_hash)
        if block is None or not block.ready:
            return False
        if block.expires_at and block.expires_at <= self.clock():
            self.expire(self.clock())
            return False
        return True

    def touch(self, fp_key: bytes, block_hash: bytes) -> None:
        key = fp_key + block_hash
        if key in self._lru:
            self._lru.move_to_end(key)

    def read(self, fp_key: bytes, block_hash: bytes, out: bytearray | memoryview) -> bool:
        """Read and verify the block into `out`; a bad file is a miss, and deleted."""
        key = fp_key + block_hash
        block = self.blocks[key]
        if not read_block(block.path, fp_key, block_hash, out):
            self.checksum_failures += 1
            logger.warning("KV disk tier: %s failed its checks: dropped (a miss)", block.path)
            self._remove(block)
            return False
        self.hits += 1
        self.touch(fp_key, block_hash)
        return True

    @property
    def num_pending(self) -> int:
        """Writes queued or under way."""
        return len(self._by_token)

    def next_expiry(self) -> float | None:
        return self._expiries[0][0] if self._expiries else None

    # ------------------------------------------------------------------------ writes

    def spill(
        self,
        fp_key: bytes,
        block_hash: bytes,
        payload_bytes: int,
        copy_payload: Callable[[], Any],
    ) -> None:
        """Write an evicted block (unpinned) when it is not on disk and finds room; the copy
        is taken only then."""
        key = fp_key + block_hash
        if key in self.blocks or len(block_hash) > MAX_HASH_BYTES:
            return
        if self.pending_spill_bytes + payload_bytes > MAX_PENDING_SPILL_BYTES:
            self.dropped += 1
            return
        block = self._admit(fp_key, block_hash, payload_bytes)
        if block is None:
            return
        payload = copy_payload()  # the slot is reused as soon as we return
        block.spill_bytes = memoryview(payload).nbytes
        self.pending_spill_bytes += block.spill_bytes
        self.spills += 1
        self._submit(block, fp_key, block_hash, payload, durable=False)

    def pin(self, fp_key: bytes, block_hash: bytes, payload: Any, expires_at: float) -> int | None:
        """Keep the block on disk until `expires_at` (wall clock), writing it if needed.

        Returns the write's token when one was queued: `payload` (the block's slot) must
        stay unchanged until finish() reports it; None when nothing is written from it.
        """
        key = fp_key + block_hash
        block = self.blocks.get(key)
        if block is not None:
            self._refresh(block, expires_at)
            return None
        if len(block_hash) > MAX_HASH_BYTES:
            return None
        block = self._admit(fp_key, block_hash, memoryview(payload).nbytes)
        if block is None:
            return None
        self._set_expiry(block, expires_at)
        return self._submit(block, fp_key, block_hash, payload, durable=True)

    def _refresh(self, block: DiskBlock, expires_at: float) -> None:
        """A pin on a block already here: the later expiry wins; the file follows when it
        lags by more than the slack (its ExpiryJob runs after any queued write: FIFO)."""
        if expires_at <= block.expires_at:
            return
        if not block.expires_at:  # an unpinned block: file_expires_at is 0, so it is written
            self._lru.pop(block.key, None)
            heapq.heappush(self._expiries, (expires_at, block.key))
        block.expires_at = expires_at  # a pinned one's heap entry re-queues itself at its time
        slack = min(EXPIRY_SLACK_S, 0.1 * (expires_at - self.clock()))
        if expires_at > block.file_expires_at + slack:
            block.file_expires_at = expires_at
            self.writer.submit(ExpiryJob(block.path, expires_at))

    def finish(self) -> list[int]:
        """Account the writes the thread finished; returns their tokens."""
        tokens = []
        for token, ok in self.writer.take_done():
            tokens.append(token)
            block = self._by_token.pop(token, None)
            if block is None:
                continue  # removed while queued; its DeleteJob followed the write
            self._settle(block)
            if not ok:
                self._remove(block)
                continue
            self.writes += 1
            if not block.expires_at:
                self._lru[block.key] = block
        return tokens

    def expire(self, now: float) -> int:
        """Delete the pinned blocks whose expiry passed; returns how many."""
        num_expired = 0
        while self._expiries and self._expiries[0][0] <= now:
            _, key = heapq.heappop(self._expiries)
            block = self.blocks.get(key)
            if block is None or not block.expires_at:
                continue  # gone meanwhile
            if block.expires_at > now:  # refreshed since it was queued
                heapq.heappush(self._expiries, (block.expires_at, key))
                continue
            self._remove(block)
            num_expired += 1
        if num_expired:
            self.expirations += num_expired
            logger.info("KV disk tier: %d pinned blocks reached their TTL: deleted", num_expired)
        return num_expired

    def close(self) -> None:
        """Finish the queued writes, stop the writer, let go of the folder (idempotent)."""
        if self._lock_fd < 0:
            return
        self.writer.stop()
        self.finish()
        self.writer.close()
        os.close(self._lock_fd)
        self._lock_fd = -1

    # ------------------------------------------------------------------------ start-up

    def scan(self) -> None:
        """Rebuild the index from the files: valid ones in mtime order (the oldest first in
        the LRU), expired, torn or foreign ones deleted, then the budget enforced."""
        started = time.monotonic()
        now, found, num_bad, num_expired = self.clock(), [], 0, 0
        for path in _block_files(self.root):
            entry = _check_file(path)
            if entry is None:
                num_bad += 1
                _unlink(path)
            elif entry[1].expires_at and entry[1].expires_at <= now:
                num_expired += 1
                _unlink(path)
            else:
                found.append(entry)
        for _, block in sorted(found, key=lambda entry: entry[0]):
            self._insert(block)
            if block.expires_at:
                self._set_expiry(block, block.expires_at)
            else:
                self._lru[block.key] = block
        self._evict_to(self.capacity_bytes)
        self.checksum_failures += num_bad
        self.expirations += num_expired
        logger.info(
            "KV disk tier at %s: %d blocks (%.1f MiB of %.1f MiB) in %.2f s; dropped %d "
            "invalid and %d expired files",
            self.root,
            len(self.blocks),
            self.used_bytes / 2**20,
            self.capacity_bytes / 2**20,
            time.monotonic() - started,
            num_bad,
            num_expired,
        )

    # ------------------------------------------------------------------------ helpers

    def _admit(self, fp_key: bytes, block_hash: bytes, payload_bytes: int) -> DiskBlock | None:
        """A new index entry for a block about to be written, or None when it finds no room."""
        nbytes = HEADER_BYTES + payload_bytes
        if nbytes > self.capacity_bytes or not self._evict_to(self.capacity_bytes - nbytes):
            self.dropped += 1
            return None
        path = block_path(self.root, fp_key, block_hash)
        block = DiskBlock(fp_key + block_hash, path, nbytes, 0.0)
        self._insert(block)
        return block

    def _submit(
        self, block: DiskBlock, fp_key: bytes, block_hash: bytes, payload: Any, durable: bool
    ) -> int:
        block.token = next(self._tokens)
        self._by_token[block.token] = block
        self.writer.submit(
            WriteJob(
                block.token, block.path, fp_key, block_hash, payload, block.expires_at, durable
            )
        )
        return block.token

    def _set_expiry(self, block: DiskBlock, expires_at: float) -> None:
        """Pin a block that was not pinned (one heap entry per pinned block)."""
        block.expires_at = block.file_expires_at = expires_at
        heapq.heappush(self._expiries, (expires_at, block.key))

    def _insert(self, block: DiskBlock) -> None:
        self.blocks[block.key] = block
        self.used_bytes += block.nbytes

    def _settle(self, block: DiskBlock) -> None:
        self.pending_spill_bytes -= block.spill_bytes
        block.spill_bytes = block.token = 0

    def _remove(self, block: DiskBlock) -> None:
        if not block.ready:
            del self._by_token[block.token]
            self._settle(block)
        del self.blocks[block.key]
        self._lru.pop(block.key, None)
        self.used_bytes -= block.nbytes
        self.writer.submit(DeleteJob(block.path))

    def _evict_to(self, budget: int) -> bool:
        """Evict the oldest unpinned blocks until used_bytes <= budget; False if it cannot."""
        while self.used_bytes > budget:
            if not self._lru:
                return False
            _, victim = self._lru.popitem(last=False)
            self._remove(victim)
            self.evictions += 1
        return True


def _lock_folder(root: str) -> int:
    """Hold an exclusive lock on root/.lock for the process's life (the kernel drops it when
    the process dies, even by SIGKILL): two stores never share one folder's index."""
    fd = os.open(os.path.join(root, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(f"--disk-path {root} is in use by another KV store") from None
    return fd


def _block_files(root: str) -> list[str]:
    """Every block file (and left-over temporary) under root/<fingerprint key hex>/; leftover
    temporaries of a killed writer are deleted here."""
    paths = []
    for pool_dir in os.scandir(root):
        if not pool_dir.is_dir(follow_symlinks=False):
            continue
        for entry in os.scandir(pool_dir.path):
            if entry.name.endswith(TMP_SUFFIX):
                _unlink(entry.path)
            elif entry.name.endswith(SUFFIX):
                paths.append(entry.path)
    return paths


def _check_file(path: str) -> tuple[float, DiskBlock] | None:
    """(mtime, its index entry) of a block file whose header holds and names its own path;
    None for a torn, truncated or foreign one (the payload's checksum is checked on read)."""
    try:
        with open(path, "rb", buffering=0) as f:
            header = unpack_header(f.read(HEADER_BYTES))
            stat = os.fstat(f.fileno())
    except OSError:
        return None
    if header is None or header.expires_at < 0:
        return None
    fp_hex = os.path.basename(os.path.dirname(path))
    if path != block_path(os.path.dirname(os.path.dirname(path)), header.fp_key, header.block_hash):
        return None  # renamed, or copied under another fingerprint
    if stat.st_size != HEADER_BYTES + header.payload_len or fp_hex != header.fp_key.hex():
        return None
    block = DiskBlock(header.fp_key + header.block_hash, path, stat.st_size, header.expires_at)
    return stat.st_mtime, block


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
