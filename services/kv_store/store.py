"""The store's bookkeeping: pools of blocks keyed by block hash, leases, LRU eviction.

No sockets and no copies here (services/kv_store/server.py moves the bytes); every method is
O(blocks it names).

- A pool holds the blocks of one layout fingerprint, in the slots of its own arena. A lookup
  or get names a pool, so a block is never served under another layout.
- Every pool draws on one byte budget (--size). A block that no lease holds is evictable; the
  evictable blocks of all pools sit in one LRU order (an OrderedDict: O(1) touch and pop).
- A lease holds blocks for a client: a put's reservation (its new blocks are invisible until
  commit, and dropped if it is released or expires), a get's slots while the client copies,
  or a pin. A lease the client never ends expires at its deadline, so a client that dies
  leaks nothing.
- Within a chain the tail goes into the LRU order first, so it is evicted first: dropping a
  chain's first block would make all the others unreachable by prefix lookups.
- With a disk tier (services/kv_store/disk_tier.py): an evicted block spills to disk, a pin
  with a TTL writes its blocks through (holding them in memory until written), a lookup
  counts disk blocks as held, and a get or pin promotes them back into slots.
"""

from __future__ import annotations

import heapq
import itertools
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvserve.services.kv_store.disk_tier import DiskTier
from kvserve.shared.messages import KvFingerprint, KvStoreStats

# Disk reads one get or pin may spend promoting blocks, in seconds (the store's loop waits
# meanwhile; a client's round trip allows 2 s by default). ~100 MB at 200 MB/s.
PROMOTE_BUDGET_S = 0.5


@dataclass(slots=True, eq=False)
class Pool:
    """The blocks of one layout fingerprint and their arena.

    Args:
        fingerprint: the layout.
        pool_id: what clients name the pool by: the layout's key + a per-store nonce.
        arena: the slots (HostArena or CudaArena), num_slots of block_bytes each.
        num_slots: slots in the arena.
    """

    fingerprint: KvFingerprint
    pool_id: bytes
    arena: Any
    num_slots: int
    block_bytes: int = 0
    blocks: dict[bytes, StoreBlock] = field(default_factory=dict)  # hash -> block
    free_slots: list[int] = field(default_factory=list)  # a min-heap of freed slots
    next_fresh_slot: int = 0  # slots from here on were never used

    def __post_init__(self) -> None:
        self.block_bytes = self.fingerprint.block_bytes

    @property
    def fp_key(self) -> bytes:
        """The layout's 16-byte key (the pool id without the per-start nonce): what the disk
        tier files blocks under, the same across restarts."""
        return self.pool_id[:16]

    def take_slot(self) -> int:
        # The lowest free slot, so a batch's slots come in few runs (blocks.py).
        if self.free_slots:
            return heapq.heappop(self.free_slots)
        assert self.next_fresh_slot < self.num_slots, "byte budget lets a pool overflow its arena"
        self.next_fresh_slot += 1
        return self.next_fresh_slot - 1

    def free_slot(self, slot: int) -> None:
        heapq.heappush(self.free_slots, slot)


@dataclass(slots=True, eq=False)
class StoreBlock:
    pool: Pool
    block_hash: bytes
    slot: int
    ref_cnt: int = 0  # leases holding it; evictable when 0 and committed
    committed: bool = False

    @property
    def lru_key(self) -> bytes:
        return self.pool.pool_id + self.block_hash


@dataclass(slots=True, eq=False)
class Lease:
    lease_id: int
    blocks: list[StoreBlock]
    deadline: float
    writes: bool  # a put's reservation


class KvBlockStore:
    """Pools, leases and the byte budget of one store process.

    Args:
        capacity_bytes: the budget of all pools together.
        lease_timeout_s: the default life of a lease.
        make_arena: (fingerprint, pool_id, num_slots) -> the arena of a new pool.
        disk: the disk tier under the memory one, if any (its index already scanned).
    """

    def __init__(
        self,
        capacity_bytes: int,
        lease_timeout_s: float,
        make_arena: Callable[[KvFingerprint, bytes, int], Any],
        disk: DiskTier | None = None,
    ):
        self.capacity_bytes = capacity_bytes
        self.lease_timeout_s = lease_timeout_s
        self._make_arena = make_arena
        self._nonce = secrets.token_bytes(4)  # pool ids change when the store restarts
        self.pools: dict[bytes, Pool] = {}
        self.leases: dict[int, Lease] = {}
        # Random start: a stale client's lease id never names a restarted store's lease.
        self._lease_ids = itertools.count(secrets.randbits(48) + 1)
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, lease_id)
        self._evictable: OrderedDict[bytes, StoreBlock] = OrderedDict()  # LRU first
        self.used_bytes = 0
        self.hits = self.misses = self.num_evicted = 0
        self.bytes_in = self.bytes_out = 0
        self.disk = disk
        self._disk_holds: dict[int, StoreBlock] = {}  # write token -> block it reads from
        self._read_buffer = bytearray()  # a promotion's read, reused

    # ------------------------------------------------------------------------ pools

    def open_pool(self, fingerprint: KvFingerprint) -> Pool:
        """The pool of `fingerprint`, created (with its arena) on first use."""
        pool_id = fingerprint.key() + self._nonce
        pool = self.pools.get(pool_id)
        if pool is None:
            num_slots = self.capacity_bytes // fingerprint.block_bytes
            if num_slots == 0:
                raise ValueError(
                    f"the store's --size ({self.capacity_bytes} bytes) holds no block of "
                    f"{fingerprint.block_bytes} bytes"
                )
            arena = self._make_arena(fingerprint, pool_id, num_slots)
            pool = self.pools[pool_id] = Pool(fingerprint, pool_id, arena, num_slots)
        return pool

    def close(self) -> None:
        if self.disk is not None:  # its writes read the arenas: finish them first
            self.disk.writer.stop()
            self.finish_disk_writes()
            self.disk.close()
        for pool in self.pools.values():
            pool.arena.close()
        self.pools.clear()

    # ------------------------------------------------------------------------ calls

    def lookup(self, pool: Pool, block_hashes: Sequence[bytes]) -> int:
        """Blocks of `block_hashes`, from the first, that the pool holds; they become the
        most recently used."""
        held = self._held_prefix(pool, block_hashes)
        for block in reversed(held):
            if block.ref_cnt == 0:
                self._evictable.move_to_end(block.lru_key)
        num_held = len(held) + self._disk_prefix(pool, block_hashes[len(held) :])
        self._count(num_held, len(block_hashes))
        return num_held

    def reserve(
        self, pool: Pool, block_hashes: Sequence[bytes], now: float
    ) -> tuple[Lease, list[int]]:
        """Put, phase 1: a lease on a slot for each block not held yet (-1 for one that is
        held: the lease keeps it from eviction until commit). Stops at the first block that
        finds no room or that another client is writing, so what gets stored is a prefix."""
        lease = self._new_lease(now + self.lease_timeout_s, writes=True)
        slots = []
        for block_hash in block_hashes:
            block = pool.blocks.get(block_hash)
            if block is not None:
                if not block.committed:
                    break
                self._ref(block)
                slots.append(-1)
            else:
                if not self._make_room(pool):
                    break
                block = StoreBlock(pool, block_hash, pool.take_slot(), ref_cnt=1)
                pool.blocks[block_hash] = block
                self.used_bytes += pool.block_bytes
                slots.append(block.slot)
            lease.blocks.append(block)
        return lease, slots

    def commit(self, lease_id: int) -> int:
        """Put, phase 2: the reservation's blocks become visible. Returns how many blocks of
        the put the store now holds; 0 for a lease that expired (or a stale id)."""
        lease = self._pop_lease(lease_id)
        if lease is None or not lease.writes:
            return 0
        for block in lease.blocks:
            if not block.committed:
                block.committed = True
                self.bytes_in += block.pool.block_bytes
        self._unref_all(lease.blocks)
        return len(lease.blocks)

    def acquire(
        self,
        pool: Pool,
        block_hashes: Sequence[bytes],
        now: float,
        ttl_s: float | None = None,
        reading: bool = True,
    ) -> Lease:
        """A lease on the held prefix of `block_hashes` (a get, or a pin when not `reading`);
        blocks held only on disk are promoted into slots. A pin with a `ttl_s` writes its
        blocks to the disk tier, keeping them there until the TTL ends (wall clock)."""
        lease = self._new_lease(now + (ttl_s or self.lease_timeout_s), writes=False)
        promote_until = None
        for block_hash in block_hashes:
            block = pool.blocks.get(block_hash)
            if block is None:
                # One block at least, then until the call's read time is spent: the loop
                # serves other clients meanwhile; a later get promotes the rest.
                if promote_until is None:
                    promote_until = time.monotonic() + PROMOTE_BUDGET_S
                elif time.monotonic() > promote_until:
                    break
                block = self._promote(pool, block_hash)
            if block is None or not block.committed:
                break
            self._ref(block)  # now: a later promotion must not evict it
            lease.blocks.append(block)
        held = lease.blocks
        if reading:
            self._count(len(held), len(block_hashes))
            self.bytes_out += len(held) * pool.block_bytes
        elif ttl_s is not None and self.disk is not None:
            self._write_through(pool, held, self.disk.clock() + ttl_s)
        return lease

    def release(self, lease_id: int) -> bool:
        """End a lease without commit: a reservation's new blocks are dropped."""
        lease = self._pop_lease(lease_id)
        if lease is None:
            return False
        if lease.writes:
            for block in reversed(lease.blocks):
                if not block.committed:
                    self._drop(block)
        self._unref_all([b for b in lease.blocks if b.committed])
        return True

    def finish_disk_writes(self) -> None:
        """Account the disk writes done; the blocks they read from may be evicted again."""
        if self.disk is None:
            return
        for token in self.disk.finish():
            block = self._disk_holds.pop(token, None)
            if block is not None:
                self._unref_all([block])

    def expire(self, now: float) -> list[Lease]:
        """End every lease past its deadline, and the disk tier's expired pins; returns the
        leases."""
        if self.disk is not None:
            self.disk.expire(self.disk.clock())
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, lease_id = heapq.heappop(self._deadlines)
            lease = self.leases.get(lease_id)
            if lease is not None and lease.deadline == deadline:
                self.release(lease_id)
                expired.append(lease)
        return expired

    def next_deadline(self, now: float | None = None) -> float | None:
        """The next lease deadline or disk pin expiry, on the leases' clock (`now`,
        time.monotonic() when None)."""
        deadlines = [self._deadlines[0][0]] if self._deadlines else []
        expiry = self.disk.next_expiry() if self.disk is not None else None
        if expiry is not None:
            assert self.disk is not None
            now = time.monotonic() if now is None else now
            deadlines.append(now + max(0.0, expiry - self.disk.clock()))
        return min(deadlines, default=None)

    def stats(self) -> KvStoreStats:
        blocks = [b for pool in self.pools.values() for b in pool.blocks.values()]
        return KvStoreStats(
            num_blocks=sum(b.committed for b in blocks),
            capacity_bytes=self.capacity_bytes,
            used_bytes=self.used_bytes,
            num_pinned=sum(b.committed and b.ref_cnt > 0 for b in blocks),
            num_reserved=sum(not b.committed for b in blocks),
            num_leases=len(self.leases),
            num_pools=len(self.pools),
            hits=self.hits,
            misses=self.misses,
            num_evicted=self.num_evicted,
            bytes_in=self.bytes_in,
            bytes_out=self.bytes_out,
            **(self._disk_stats() if self.disk is not None else {}),
        )

    def _disk_stats(self) -> dict[str, int]:
        disk = self.disk
        assert disk is not None
        return dict(
            disk_capacity_bytes=disk.capacity_bytes,
            disk_blocks=len(disk.blocks),
            disk_bytes=disk.used_bytes,
            disk_pinned=sum(block.expires_at > 0 for block in disk.blocks.values()),
            disk_hits=disk.hits,
            disk_spills=disk.spills,
            disk_writes=disk.writes,
            disk_evictions=disk.evictions,
            disk_checksum_failures=disk.checksum_failures,
            disk_expirations=disk.expirations,
            disk_dropped=disk.dropped,
            disk_pending_writes=disk.num_pending,
        )

    # ------------------------------------------------------------------------ helpers

    def _held_prefix(self, pool: Pool, block_hashes: Sequence[bytes]) -> list[StoreBlock]:
        held = []
        for block_hash in block_hashes:
            block = pool.blocks.get(block_hash)
            if block is None or not block.committed:
                break
            held.append(block)
        return held

    def _count(self, num_hits: int, num_asked: int) -> None:
        self.hits += num_hits
        self.misses += num_asked - num_hits

    def _new_lease(self, deadline: float, writes: bool) -> Lease:
        lease = Lease(next(self._lease_ids), [], deadline, writes)
        self.leases[lease.lease_id] = lease
        heapq.heappush(self._deadlines, (deadline, lease.lease_id))
        return lease

    def _pop_lease(self, lease_id: int) -> Lease | None:
        # Its deadline entry stays in the heap; expire() skips ids no longer leased.
        return self.leases.pop(lease_id, None)

    def _ref(self, block: StoreBlock) -> None:
        if block.ref_cnt == 0 and block.committed:
            del self._evictable[block.lru_key]
        block.ref_cnt += 1

    def _unref_all(self, blocks: Sequence[StoreBlock]) -> None:
        # Tail first into the LRU order: a chain is evicted from its end.
        for block in reversed(blocks):
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, "a block released more often than leased"
            if block.ref_cnt == 0:
                self._evictable[block.lru_key] = block

    def _make_room(self, pool: Pool) -> bool:
        """Evict least recently used blocks until one block of `pool` fits the budget."""
        while self.used_bytes + pool.block_bytes > self.capacity_bytes:
            if not self._evictable:
                return False
            _, victim = self._evictable.popitem(last=False)
            self.num_evicted += 1
            self._spill(victim)
            self._drop(victim)
            if victim.pool is not pool:
                victim.pool.arena.release_pages(victim.slot)
        return True

    def _drop(self, block: StoreBlock) -> None:
        del block.pool.blocks[block.block_hash]
        block.pool.free_slot(block.slot)
        self.used_bytes -= block.pool.block_bytes

    # ------------------------------------------------------------------------ disk tier

    def _disk_prefix(self, pool: Pool, block_hashes: Sequence[bytes]) -> int:
        """How many of `block_hashes`, from the first, memory or disk holds (no I/O)."""
        num_held = 0
        for block_hash in block_hashes:
            block = pool.blocks.get(block_hash)
            if block is not None and block.committed:
                if block.ref_cnt == 0:
                    self._evictable.move_to_end(block.lru_key)
            elif self.disk is not None and self.disk.holds(pool.fp_key, block_hash):
                self.disk.touch(pool.fp_key, block_hash)
            else:
                break
            num_held += 1
        return num_held

    def _promote(self, pool: Pool, block_hash: bytes) -> StoreBlock | None:
        """Read a block held only on disk into a fresh slot (evictable; the caller refs it)."""
        disk = self.disk
        if disk is None or not disk.holds(pool.fp_key, block_hash):
            return None
        # Most recent first: the spills that make room below evict other files before it.
        disk.touch(pool.fp_key, block_hash)
        if not self._make_room(pool) or not disk.holds(pool.fp_key, block_hash):
            return None
        slot = pool.take_slot()
        if not self._read_into_slot(pool, block_hash, slot):
            pool.free_slot(slot)
            return None
        block = StoreBlock(pool, block_hash, slot, committed=True)
        pool.blocks[block_hash] = block
        self.used_bytes += pool.block_bytes
        self._evictable[block.lru_key] = block
        return block

    def _read_into_slot(self, pool: Pool, block_hash: bytes, slot: int) -> bool:
        assert self.disk is not None
        target = pool.arena.slot_buffer(slot)  # the shared memory itself: no second copy
        if target is not None:
            return self.disk.read(pool.fp_key, block_hash, target)
        if len(self._read_buffer) != pool.block_bytes:
            self._read_buffer = bytearray(pool.block_bytes)
        if not self.disk.read(pool.fp_key, block_hash, self._read_buffer):
            return False
        pool.arena.write_run(slot, np.frombuffer(self._read_buffer, dtype=np.uint8)[None])
        return True

    def _write_through(self, pool: Pool, blocks: Sequence[StoreBlock], expires_at: float) -> None:
        """Pin `blocks` on disk until `expires_at`; each one written from its slot stays
        referenced (unevictable, its slot unchanged) until the writer is done with it."""
        assert self.disk is not None
        for block in blocks:
            payload = pool.arena.read_run(block.slot, 1)
            token = self.disk.pin(pool.fp_key, block.block_hash, payload, expires_at)
            if token is not None:
                self._ref(block)
                self._disk_holds[token] = block

    def _spill(self, victim: StoreBlock) -> None:
        if self.disk is not None:
            pool = victim.pool
            self.disk.spill(
                pool.fp_key,
                victim.block_hash,
                pool.block_bytes,
                lambda: bytes(pool.arena.read_run(victim.slot, 1)),
            )
