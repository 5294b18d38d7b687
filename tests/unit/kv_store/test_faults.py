"""A store that dies, restarts, or outlives its clients: calls fail fast, leases never leak."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from kvserve.services.kv_store import client as client_module
from kvserve.services.kv_store.client import KvStoreClient, KvStoreUnavailable
from tests.support.kv_store import chain, random_caches


def _segments(pid: int) -> list[str]:
    return glob.glob(f"/dev/shm/kvserve-kv-*-{pid}")


@pytest.mark.parametrize("via", ["ipc", "tcp"])
def test_killed_store_fails_fast_and_a_restarted_one_serves_again(start_store, fingerprint, via):
    store = start_store("--size", "1M")
    address = store.ipc if via == "ipc" else store.tcp
    src = random_caches(fingerprint, 4, seed=5)
    dst = [torch.zeros_like(cache) for cache in src]
    hashes = chain("restart", 2)
    client = KvStoreClient(address, fingerprint, timeout_s=10)  # the store is starting
    assert client.put(hashes, src, [0, 1]) == 2
    client.timeout_s = 0.5
    old_pid = store.proc.pid
    store.kill()
    for call in (lambda: client.lookup(hashes), lambda: client.get(hashes, dst, [2, 3])):
        started = time.monotonic()
        with pytest.raises(KvStoreUnavailable, match="did not answer"):
            call()
        assert time.monotonic() - started < 1.5
    store.restart()
    client.timeout_s = 10  # the new process takes a moment to bind
    assert client.lookup(hashes) == 0  # a new store is empty
    assert client.put(hashes, src, [0, 1]) == 2
    assert client.get(hashes, dst, [2, 3]) == 2
    assert all(torch.equal(d[:, 2:4], s[:, 0:2]) for s, d in zip(src, dst))
    client.close()
    deadline = time.monotonic() + 5
    while _segments(old_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _segments(old_pid), "the killed store's arena was not unlinked"


def test_a_client_idle_across_a_restart_rejoins_the_new_arena(start_store, fingerprint):
    store = start_store("--size", "1M")
    src = random_caches(fingerprint, 4, seed=6)
    dst = [torch.zeros_like(cache) for cache in src]
    client = KvStoreClient(store.ipc, fingerprint, timeout_s=10)
    assert client.put(chain("idle", 1), src, [0]) == 1
    assert store.stop() == 0
    store.restart()
    # The old pool id is refused (unknown pool), the client says hello and maps the new arena.
    assert client.put(chain("idle", 2), src, [1, 2]) == 2
    assert client.get(chain("idle", 2), dst, [0, 3]) == 2
    assert torch.equal(dst[0][:, [0, 3]], src[0][:, [1, 2]])
    client.close()


_RESERVE_AND_DIE = textwrap.dedent(
    """
    import os, sys
    from kvserve.services.kv_store.client import KvStoreClient
    from kvserve.shared.messages import KvReserve
    from tests.support.kv_store import chain, tiny_fingerprint

    client = KvStoreClient(sys.argv[1], tiny_fingerprint())
    lease, _ = client._pool_call(lambda c, p: KvReserve(c, p, chain("dying", 3)))
    print(len(lease.slots), flush=True)
    os._exit(0)  # no commit, no release
    """
)


def test_reservation_of_a_client_that_dies_is_reclaimed(start_store, fingerprint):
    store = start_store("--size", "4K", "--lease-timeout-s", "1")
    out = subprocess.run(
        [sys.executable, "-c", _RESERVE_AND_DIE, store.ipc],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert out.stdout.strip() == "3"
    with KvStoreClient(store.ipc, fingerprint, timeout_s=5) as client:
        stats = client.stats()
        if stats.num_leases:  # not expired yet (it may have: the child took its time)
            assert (stats.num_reserved, stats.used_bytes) == (3, 3 * 1024)
        assert client.lookup(chain("dying", 3)) == 0  # never visible
        time.sleep(1.2)
        stats = client.stats()
        assert (stats.num_reserved, stats.num_leases, stats.used_bytes) == (0, 0, 0)
        caches = random_caches(fingerprint, 4)
        assert client.put(chain("after", 4), caches, [0, 1, 2, 3]) == 4  # all room is back


def test_no_pins_left_after_an_abort_storm(start_store, fingerprint, monkeypatch):
    store = start_store("--size", "64K")
    caches = random_caches(fingerprint, 8)
    hashes = chain("storm", 4)
    with (
        KvStoreClient(store.ipc, fingerprint) as client,
        KvStoreClient(store.tcp, fingerprint) as remote,
    ):
        assert client.put(hashes, caches, [0, 1, 2, 3]) == 4
        for _ in range(25):
            client.unpin(client.pin(hashes))
            assert client.get(hashes, caches, [4, 5, 6, 7]) == 4
            assert remote.get(hashes, caches, [4, 5, 6, 7]) == 4

        def broken_copy(*args):
            raise RuntimeError("copy failed")

        monkeypatch.setattr(client_module, "copy_slots_to_blocks", broken_copy)
        monkeypatch.setattr(client_module, "copy_blocks_to_slots", broken_copy)
        for i in range(25):
            with pytest.raises(RuntimeError, match="copy failed"):
                client.get(hashes, caches, [4, 5, 6, 7])
            with pytest.raises(RuntimeError, match="copy failed"):
                client.put(chain(f"aborted-{i}", 2), caches, [0, 1])
        stats = client.stats()
    assert (stats.num_pinned, stats.num_reserved, stats.num_leases) == (0, 0, 0)
    assert stats.num_blocks == 4  # the aborted puts left nothing


def test_sigterm_stops_the_store_and_removes_its_shared_memory(start_store, fingerprint):
    store = start_store("--size", "1M")
    with KvStoreClient(store.ipc, fingerprint) as client:
        client.put(chain("bye", 1), random_caches(fingerprint, 1), [0])
        assert _segments(store.proc.pid)
    assert store.stop() == 0
    assert not _segments(store.proc.pid)
    assert not os.path.exists(store.ipc.removeprefix("ipc://"))
