"""The store's bookkeeping, the copy paths and the CUDA handle packing, in one process."""

from __future__ import annotations

import mmap
import os

import msgspec
import pytest
import torch

from kvserve.services.kv_store.arena import (
    CudaArena,
    HostArena,
    pack_cuda_handle,
    slot_runs,
    unpack_cuda_handle,
)
from kvserve.services.kv_store.blocks import copy_blocks_to_slots, copy_slots_to_blocks
from kvserve.services.kv_store.store import KvBlockStore
from kvserve.shared.messages import KvCudaArenaHandle, KvFingerprint
from tests.support.kv_store import chain, random_caches, tiny_fingerprint


class _FakeArena:
    def __init__(self):
        self.released: list[int] = []

    def release_pages(self, slot: int) -> None:
        self.released.append(slot)

    def close(self) -> None:
        pass


def _store(num_blocks: int, lease_timeout_s: float = 10.0) -> KvBlockStore:
    return KvBlockStore(num_blocks * 1024, lease_timeout_s, lambda fp, pool_id, n: _FakeArena())


def test_fingerprint_key_is_stable_and_covers_every_field():
    fp = tiny_fingerprint()
    assert fp.key() == tiny_fingerprint().key() and len(fp.key()) == 16
    changed = [tiny_fingerprint(**{k: v}) for k, v in (("tp_rank", 1), ("block_size", 8))]
    assert len({fp.key(), *(other.key() for other in changed)}) == 3
    assert fp.block_bytes == 2 * 2 * 4 * 2 * 8 * 4
    with pytest.raises(ValueError, match="dtype"):
        tiny_fingerprint("float64")


def test_reserved_blocks_are_invisible_until_commit_and_dropped_on_release():
    store = _store(8)
    pool = store.open_pool(tiny_fingerprint())
    lease, slots = store.reserve(pool, chain("a", 3), now=0.0)
    assert slots == [0, 1, 2]
    assert store.lookup(pool, chain("a", 3)) == 0
    assert store.commit(lease.lease_id) == 3
    assert store.lookup(pool, chain("a", 3)) == 3
    # A chain that is partly held: -1 for the held block, a slot for the new one.
    lease, slots = store.reserve(pool, chain("a", 4), now=0.0)
    assert slots == [-1, -1, -1, 3]
    assert store.release(lease.lease_id)
    assert store.lookup(pool, chain("a", 4)) == 3
    assert store.stats().used_bytes == 3 * 1024 and not store.commit(lease.lease_id)


def test_expired_leases_are_reclaimed():
    store = _store(4, lease_timeout_s=1.0)
    pool = store.open_pool(tiny_fingerprint())
    store.reserve(pool, chain("w", 2), now=0.0)
    lease, _ = store.reserve(pool, chain("done", 1), now=0.0)
    store.commit(lease.lease_id)
    store.acquire(pool, chain("done", 1), now=0.5)
    assert store.next_deadline() == 1.0
    assert [len(lease.blocks) for lease in store.expire(now=1.0)] == [2]
    assert [len(lease.blocks) for lease in store.expire(now=1.5)] == [1]
    stats = store.stats()
    assert (stats.num_leases, stats.num_pinned, stats.num_reserved, stats.num_blocks) == (
        0,
        0,
        0,
        1,
    )


def test_pools_share_the_budget_and_cross_pool_eviction_frees_pages():
    store = _store(2)
    first = store.open_pool(tiny_fingerprint())
    second = store.open_pool(tiny_fingerprint(tp_rank=1))
    lease, _ = store.reserve(first, chain("x", 2), now=0.0)
    store.commit(lease.lease_id)
    lease, slots = store.reserve(second, chain("x", 2), now=0.0)
    assert slots == [0, 1] and store.commit(lease.lease_id) == 2
    assert store.lookup(first, chain("x", 2)) == 0
    assert sorted(first.arena.released) == [0, 1]


def test_slot_runs():
    assert slot_runs([]) == []
    assert slot_runs([5]) == [(0, 5, 1)]
    assert slot_runs([7, 8, 9, 3, 4, 0]) == [(0, 7, 3), (3, 3, 2), (5, 0, 1)]


@pytest.mark.parametrize("slots", [[2, 3, 4, 5, 6, 7], [11, 0, 9, 4, 2, 7]])  # few / many runs
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_copies_through_a_slots_view_are_exact(slots, dtype):
    fp = tiny_fingerprint(dtype)
    src = random_caches(fp, 10, seed=4)
    dst = [torch.zeros_like(cache) for cache in src]
    view = torch.zeros(12, fp.num_layers, 2, fp.block_elements, dtype=getattr(torch, dtype))
    src_ids, dst_ids = [9, 0, 3, 4, 8, 1], [0, 1, 2, 5, 6, 9]
    copy_blocks_to_slots(src, src_ids, view, slots)
    copy_slots_to_blocks(view, slots, dst, dst_ids)
    for s, d in zip(src, dst):
        assert torch.equal(d[:, dst_ids], s[:, src_ids])


def test_host_arena_attach_sees_the_store_writes():
    arena = HostArena.create(f"kvserve-kv-test-{os.getpid()}", 4, 2 * mmap.PAGESIZE)
    try:
        client = HostArena.attach(arena.handle)
        arena.slots_np[2] = 7
        assert client.slots_np[2].min() == 7 and client.slots_np[1].max() == 0
        arena.release_pages(2)  # its pages go back: they read as zeros again
        assert client.slots_np[2].max() == 0
        client.close()
    finally:
        arena.close()


def test_cuda_handle_packing_round_trips():
    shared = (0, b"\x01" * 64, 1 << 20, 0, b"ref-counter", 128, b"\x02" * 64, True)
    handle = pack_cuda_handle(shared, num_slots=16, slot_bytes=65536)
    assert isinstance(handle, KvCudaArenaHandle)
    assert unpack_cuda_handle(handle) == shared
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(handle), type=KvCudaArenaHandle)
    assert unpack_cuda_handle(wire) == shared
    with pytest.raises(ValueError, match="fields"):
        pack_cuda_handle(shared[:5], 16, 65536)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_arena_is_shared_through_ipc_handles():
    fp = KvFingerprint(
        model="m", dtype="float32", block_size=4, num_layers=2, num_kv_heads=2, head_size=8
    )
    arena = CudaArena(0, 4, fp.block_bytes)
    arena.slots[1].fill_(3)
    # In-process _new_shared_cuda maps the same memory (a second process does it for real).
    attached = CudaArena.attach(arena.handle)
    assert attached.shape == (4, fp.block_bytes) and int(attached[1].min()) == 3
