"""Capacity of a real store process: LRU eviction, pins, a full store, its stats."""

from __future__ import annotations

from kvserve.services.kv_store.client import KvStoreClient
from tests.support.kv_store import chain, random_caches


def test_least_recently_used_chain_is_evicted(start_store, fingerprint):
    store = start_store("--size", "4K")  # 4 blocks of 1 KiB
    caches = random_caches(fingerprint, 8)
    old, recent, new = chain("old", 2), chain("recent", 2), chain("new", 2)
    with KvStoreClient(store.ipc, fingerprint) as client:
        assert client.put(old, caches, [0, 1]) == 2
        assert client.put(recent, caches, [2, 3]) == 2
        assert client.lookup(old) == 2  # old becomes the most recently used
        assert client.put(new, caches, [4, 5]) == 2
        assert client.lookup(recent) == 0
        assert client.lookup(old) == 2
        assert client.lookup(new) == 2
        stats = client.stats()
        assert (stats.num_blocks, stats.num_evicted, stats.used_bytes) == (4, 2, 4096)


def test_a_chain_is_evicted_from_its_tail(start_store, fingerprint):
    store = start_store("--size", "4K")
    caches = random_caches(fingerprint, 8)
    first, second = chain("first", 4), chain("second", 1)
    with KvStoreClient(store.ipc, fingerprint) as client:
        assert client.put(first, caches, [0, 1, 2, 3]) == 4
        assert client.put(second, caches, [4]) == 1
        assert client.lookup(first) == 3  # the tail went, the prefix still hits


def test_pinned_blocks_are_not_evicted_and_a_full_store_stores_a_prefix(start_store, fingerprint):
    store = start_store("--size", "4K")
    caches = random_caches(fingerprint, 8)
    pinned_chain, other = chain("pinned", 3), chain("other", 3)
    with KvStoreClient(store.tcp, fingerprint) as client:
        assert client.put(pinned_chain, caches, [0, 1, 2]) == 3
        pin = client.pin(pinned_chain)
        assert pin.num_blocks == 3
        assert client.stats().num_pinned == 3
        # One slot is free and nothing is evictable: one of three blocks goes in.
        assert client.put(other, caches, [3, 4, 5]) == 1
        assert client.lookup(pinned_chain) == 3
        client.unpin(pin)
        assert client.stats().num_pinned == 0
        assert client.put(other, caches, [3, 4, 5]) == 3  # now the pinned chain gives way
        assert client.lookup(other) == 3
        assert client.lookup(pinned_chain) == 1


def test_stats_count_hits_misses_and_bytes(start_store, fingerprint):
    store = start_store("--size", "64K")
    caches = random_caches(fingerprint, 4)
    hashes = chain("stats", 3)
    with KvStoreClient(store.ipc, fingerprint) as client:
        client.put(hashes[:2], caches, [0, 1])
        client.lookup(hashes)  # 2 hits, 1 miss
        client.get(hashes, caches, [1, 2, 3])  # 2 hits, 1 miss
        stats = client.stats()
    assert (stats.hits, stats.misses) == (4, 2)
    assert (stats.bytes_in, stats.bytes_out) == (2 * 1024, 2 * 1024)
    assert (stats.capacity_bytes, stats.num_pools, stats.num_leases) == (64 * 1024, 1, 0)
