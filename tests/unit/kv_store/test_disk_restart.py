"""A real `kvserve kv-store` with a disk tier, SIGKILLed and restarted on the same folder."""

from __future__ import annotations

import time

import torch

from kvserve.services.kv_store.client import KvStoreClient
from tests.support.kv_store import chain, random_caches


def _wait_for_writes(client: KvStoreClient, num_pinned: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = client.stats()
        if stats.disk_pending_writes == 0 and stats.disk_pinned == num_pinned:
            return
        time.sleep(0.02)
    raise AssertionError(f"pin writes not done: {client.stats()}")


def test_pinned_blocks_outlive_a_killed_store_until_their_ttl(start_store, fingerprint, tmp_path):
    disk_flags = ("--disk-path", str(tmp_path / "disk"), "--disk-bytes", "1M")
    store = start_store("--size", "64K", *disk_flags)
    src = random_caches(fingerprint, 5, seed=7)
    dst = [torch.zeros_like(cache) for cache in src]
    keep, brief = chain("keep", 3), chain("brief", 2)
    client = KvStoreClient(store.ipc, fingerprint, timeout_s=10)  # the store is starting
    assert client.put(keep, src, [0, 1, 2]) == 3 and client.put(brief, src, [3, 4]) == 2
    pins = [client.pin(keep, ttl_s=3600), client.pin(brief, ttl_s=1.0)]
    pinned_at = time.monotonic()
    _wait_for_writes(client, num_pinned=5)
    store.kill()
    time.sleep(max(0.0, pinned_at + 1.1 - time.monotonic()))  # `brief`'s TTL passes
    store.restart()

    assert client.lookup(brief) == 0
    with KvStoreClient(store.tcp, fingerprint, timeout_s=10) as remote:  # frames: promoted too
        assert remote.get(keep[:1], dst, [1]) == 1
    assert client.get(keep, dst, [2, 3, 4]) == 3
    assert torch.equal(dst[0][:, 1], src[0][:, 0])
    assert all(torch.equal(d[:, 2:5], s[:, 0:3]) for s, d in zip(src, dst))
    for pin in pins:
        client.unpin(pin)  # leases of the killed store: nothing to end
    stats = client.stats()
    assert (stats.disk_hits, stats.disk_expirations, stats.disk_blocks) == (3, 2, 3)
    assert (stats.num_leases, stats.num_pinned, stats.num_reserved) == (0, 0, 0)
    assert stats.disk_checksum_failures == 0 and stats.num_blocks == 3
    client.close()
