"""The store's disk tier on real files and real shared-memory arenas, in one process: pin
write-through, spills, promotion, a restart's index rebuild, expiry, bad files, the budget."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from kvserve.services.kv_store import store as store_module
from kvserve.services.kv_store.arena import HostArena
from kvserve.services.kv_store.disk_format import HEADER_BYTES, block_path, unpack_header
from kvserve.services.kv_store.disk_tier import DiskTier
from kvserve.services.kv_store.store import KvBlockStore, Pool
from kvserve.shared.launch_options import KvStoreOptions
from kvserve.shared.messages import KvFingerprint
from tests.support.kv_store import chain, tiny_fingerprint

BLOCK = tiny_fingerprint().block_bytes  # 1 KiB
FILE = HEADER_BYTES + BLOCK


class _Clock:
    """Wall-clock seconds the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _make_arena(fp: KvFingerprint, pool_id: bytes, num_slots: int) -> HostArena:
    return HostArena.create(f"kvserve-kv-test-{uuid.uuid4().hex[:12]}", num_slots, fp.block_bytes)


class _Stores:
    """Opens stores over one disk folder; a 'restart' is close() then open()."""

    def __init__(self, root: str, clock: _Clock):
        self.root, self.clock = root, clock
        self.opened: list[KvBlockStore] = []

    def open(self, mem_blocks: int = 8, disk_files: int = 16) -> KvBlockStore:
        disk = DiskTier(self.root, disk_files * FILE, clock=self.clock)
        disk.scan()
        self.opened.append(KvBlockStore(mem_blocks * BLOCK, 30.0, _make_arena, disk=disk))
        return self.opened[-1]

    def close_all(self) -> None:
        for store in self.opened:
            store.close()  # again for most: a no-op


@pytest.fixture
def stores(tmp_path) -> Iterator[_Stores]:
    made = _Stores(str(tmp_path / "disk"), _Clock())
    yield made
    made.close_all()


def _put(store: KvBlockStore, pool: Pool, hashes: list[bytes], seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    lease, slots = store.reserve(pool, hashes, now=0.0)
    payloads = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in slots]
    for slot, payload in zip(slots, payloads):
        pool.arena.write_run(slot, payload[None])
    assert store.commit(lease.lease_id) == len(hashes)
    return [payload.tobytes() for payload in payloads]


def _get(store: KvBlockStore, pool: Pool, hashes: list[bytes]) -> list[bytes]:
    lease = store.acquire(pool, hashes, now=0.0)
    blocks = [bytes(pool.arena.read_run(block.slot, 1)) for block in lease.blocks]
    store.release(lease.lease_id)
    return blocks


def _pin(store: KvBlockStore, pool: Pool, hashes: list[bytes], ttl_s: float) -> None:
    lease = store.acquire(pool, hashes, now=0.0, ttl_s=ttl_s, reading=False)
    assert len(lease.blocks) == len(hashes)
    store.release(lease.lease_id)  # the memory pin ends; the disk one holds until the TTL


def _settle(store: KvBlockStore) -> None:
    assert store.disk is not None
    store.disk.writer.wait_idle()
    store.finish_disk_writes()


def _assert_no_leaks(store: KvBlockStore) -> None:
    _settle(store)
    stats = store.stats()
    assert (stats.num_leases, stats.num_pinned, stats.num_reserved) == (0, 0, 0)
    assert stats.disk_pending_writes == 0 and not store._disk_holds


def _files(root: str) -> list[str]:
    return sorted(
        os.path.join(d, name) for d, _, names in os.walk(root) for name in names if "kvb" in name
    )


def test_pinned_blocks_survive_a_restart_byte_identical(stores):
    store = stores.open()
    pool = store.open_pool(tiny_fingerprint())
    hashes = chain("pinned", 3)
    payloads = _put(store, pool, hashes, seed=1)
    _pin(store, pool, hashes, ttl_s=3600)
    _assert_no_leaks(store)
    assert len(_files(stores.root)) == 3 and store.stats().disk_pinned == 3
    store.close()

    store = stores.open()
    pool = store.open_pool(tiny_fingerprint())
    assert store.lookup(pool, hashes + chain("never", 1)) == 3  # from the index, no read
    assert _get(store, pool, hashes) == payloads
    stats = store.stats()
    assert (stats.disk_hits, stats.num_blocks, stats.disk_pinned) == (3, 3, 3)
    assert _get(store, pool, hashes) == payloads  # now from memory
    assert store.stats().disk_hits == 3
    _assert_no_leaks(store)


def test_an_expired_pin_is_gone_at_runtime_and_after_a_restart(stores):
    store = stores.open()
    pool = store.open_pool(tiny_fingerprint())
    short, long = chain("short", 2), chain("long", 2)
    _put(store, pool, short + long, seed=2)
    _pin(store, pool, short, ttl_s=10)
    _pin(store, pool, long, ttl_s=100)
    _pin(store, pool, long, ttl_s=1000)  # a refresh: the file's expiry moves on
    _settle(store)
    stores.clock.now += 11
    store.expire(now=0.0)
    _settle(store)
    assert store.stats().disk_expirations == 2 and len(_files(stores.root)) == 2
    store.close()

    stores.clock.now += 500  # past the first TTL of `long`, within its refreshed one
    store = stores.open()
    pool = store.open_pool(tiny_fingerprint())
    assert store.lookup(pool, long) == 2 and store.lookup(pool, short) == 0
    store.close()

    stores.clock.now += 1000
    store = stores.open()
    assert store.stats().disk_expirations == 2 and _files(stores.root) == []
    _assert_no_leaks(store)


def test_a_refresh_within_the_slack_extends_the_pin_without_a_rewrite(stores):
    store = stores.open(mem_blocks=2, disk_files=8)
    pool = store.open_pool(tiny_fingerprint())
    hashes = chain("agent", 2)
    _put(store, pool, hashes, seed=9)
    first_expiry = stores.clock.now + 600
    _pin(store, pool, hashes, ttl_s=600)
    stores.clock.now += 30
    _pin(store, pool, hashes, ttl_s=600)  # 30 s later: within the 60 s slack, no rewrite
    _settle(store)
    path = block_path(stores.root, tiny_fingerprint().key(), hashes[0])
    with open(path, "rb") as f:
        header = unpack_header(f.read(HEADER_BYTES))
    assert header is not None and header.expires_at == first_expiry
    stores.clock.now += 590  # past the first expiry, within the refreshed one
    _put(store, pool, chain("flood", 2), seed=10)  # memory holds 2: `hashes` only on disk now
    store.expire(now=0.0)
    assert store.lookup(pool, hashes) == 2 and store.stats().disk_expirations == 0
    stores.clock.now += 31
    store.expire(now=0.0)
    assert store.lookup(pool, hashes) == 0 and store.stats().disk_expirations == 2
    _assert_no_leaks(store)


def test_evicted_blocks_spill_and_a_get_promotes_them(stores):
    store = stores.open(mem_blocks=4, disk_files=16)
    pool = store.open_pool(tiny_fingerprint())
    first, second = chain("first", 4), chain("second", 4)
    first_payloads = _put(store, pool, first, seed=3)
    _put(store, pool, second, seed=4)  # evicts all of `first` from memory
    _settle(store)
    stats = store.stats()
    assert (stats.num_evicted, stats.disk_spills, stats.disk_blocks) == (4, 4, 4)
    assert store.lookup(pool, first) == 4
    assert _get(store, pool, first) == first_payloads  # promoted back (evicting `second`)
    assert store.stats().disk_hits == 4
    _assert_no_leaks(store)


def test_a_get_promotes_within_its_read_budget_and_the_next_one_goes_on(stores, monkeypatch):
    store = stores.open(mem_blocks=4, disk_files=16)
    pool = store.open_pool(tiny_fingerprint())
    hashes = chain("long", 3)
    payloads = _put(store, pool, hashes, seed=11)
    _put(store, pool, chain("other", 4), seed=12)  # `hashes` now on disk only
    _settle(store)
    monkeypatch.setattr(store_module, "PROMOTE_BUDGET_S", 0.0)  # one block per call
    assert store.lookup(pool, hashes) == 3
    assert _get(store, pool, hashes) == payloads[:1]
    assert _get(store, pool, hashes) == payloads[:2]
    assert _get(store, pool, hashes) == payloads
    _assert_no_leaks(store)


def test_bad_files_are_misses_never_wrong_kv(stores):
    store = stores.open()
    fp, other_fp = tiny_fingerprint(), tiny_fingerprint(model="other")
    pool, other = store.open_pool(fp), store.open_pool(other_fp)
    hashes = chain("bad", 5)
    payloads = _put(store, pool, hashes, seed=5)
    _pin(store, pool, hashes, ttl_s=3600)
    _settle(store)
    store.close()
    paths = [block_path(stores.root, fp.key(), h) for h in hashes]
    _flip_byte(paths[1], HEADER_BYTES + 100)  # the payload: found on read
    _flip_byte(paths[2], 30)  # the header: found at start-up
    with open(paths[3], "r+b") as f:
        f.truncate(HEADER_BYTES + BLOCK // 2)
    foreign = block_path(stores.root, other_fp.key(), hashes[4])
    os.makedirs(os.path.dirname(foreign))
    shutil.copy(paths[4], foreign)  # right name, another fingerprint inside
    shutil.copy(paths[0], paths[0] + ".tmp")  # a write the killed writer never renamed

    store = stores.open()
    pool, other = store.open_pool(fp), store.open_pool(other_fp)
    # The torn header, the truncated file and the foreign one go at start-up.
    assert store.stats().disk_checksum_failures == 3
    assert store.lookup(other, hashes[4:]) == 0
    assert _get(store, pool, hashes[:1]) == payloads[:1]
    assert store.lookup(pool, hashes) == 2  # the flipped payload looks fine until it is read
    assert _get(store, pool, hashes) == payloads[:1]
    assert _get(store, pool, hashes[4:]) == payloads[4:]
    assert store.stats().disk_checksum_failures == 4
    _assert_no_leaks(store)
    assert not any(os.path.exists(p) for p in (paths[1], paths[3], paths[0] + ".tmp"))


def test_the_byte_budget_holds_under_a_flood_and_pins_are_kept(stores):
    store = stores.open(mem_blocks=4, disk_files=10)
    pool = store.open_pool(tiny_fingerprint())
    pinned = chain("keep", 3)
    pinned_payloads = _put(store, pool, pinned, seed=6)
    _pin(store, pool, pinned, ttl_s=3600)
    for i in range(30):
        _settle(store)  # what the server's loop does when the writer wakes it
        _put(store, pool, chain(f"flood-{i}", 2), seed=100 + i)
        stats = store.stats()
        assert stats.disk_bytes <= 10 * FILE and stats.used_bytes <= 4 * BLOCK
    _settle(store)
    assert sum(os.path.getsize(p) for p in _files(stores.root)) <= 10 * FILE
    stats = store.stats()
    assert stats.disk_blocks == 10  # full: 3 pinned + the 7 newest spills
    # Every settled write is held or was evicted (spills only: a pin is never evicted).
    assert stats.disk_evictions > 0
    assert stats.disk_writes - stats.disk_evictions == stats.disk_blocks
    assert store.lookup(pool, chain("flood-0", 2)) == 0
    assert _get(store, pool, pinned) == pinned_payloads
    _assert_no_leaks(store)


def test_a_failed_write_leaves_no_entry_and_no_held_block(stores):
    store = stores.open()
    pool = store.open_pool(tiny_fingerprint())
    hashes = chain("unwritable", 2)
    payloads = _put(store, pool, hashes, seed=13)
    with open(os.path.join(stores.root, tiny_fingerprint().key().hex()), "w"):
        pass  # a file where the pool's folder goes: every write fails
    _pin(store, pool, hashes, ttl_s=3600)
    _assert_no_leaks(store)
    stats = store.stats()
    assert (stats.disk_blocks, stats.disk_bytes, stats.num_blocks) == (0, 0, 2)
    assert stats.disk_writes == 0
    assert _get(store, pool, hashes) == payloads


def test_a_folder_serves_one_store_at_a_time_and_bad_flags_are_refused(stores, tmp_path):
    stores.open()
    with pytest.raises(ValueError, match="in use by another KV store"):
        DiskTier(stores.root, 16 * FILE)
    with pytest.raises(ValueError, match="--disk-bytes must be positive"):
        KvStoreOptions(disk_path=stores.root, disk_bytes=0)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="is not a folder"):
        KvStoreOptions(disk_path=str(tmp_path / "a-file"))


def _flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
