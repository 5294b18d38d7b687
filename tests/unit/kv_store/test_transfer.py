"""Blocks through a real store process: arena (ipc://) and frames (tcp://), bit-equal."""

from __future__ import annotations

import pytest
import torch

from kvserve.services.kv_store.client import KvStoreClient
from tests.support.kv_store import chain, random_caches, tiny_fingerprint


@pytest.fixture(scope="module")
def store():
    from tests.support.kv_store import StoreProcess

    process = StoreProcess("--size", "1M")
    yield process
    assert process.stop() == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("via", ["ipc", "tcp"])
def test_put_then_get_is_bit_equal(store, via, dtype):
    fp = tiny_fingerprint(dtype)
    address = store.ipc if via == "ipc" else store.tcp
    with KvStoreClient(address, fp, timeout_s=10) as client:
        assert client.use_arena == (via == "ipc")
        src = random_caches(fp, num_blocks=16, seed=1)
        dst = [torch.zeros_like(cache) for cache in src]
        hashes = chain(f"equal-{via}-{dtype}", 6)
        src_ids, dst_ids = [9, 3, 4, 5, 15, 0], [1, 2, 3, 10, 11, 7]
        assert client.put(hashes, src, src_ids) == 6
        assert client.get(hashes, dst, dst_ids) == 6
        for s, d in zip(src, dst):
            assert torch.equal(d[:, dst_ids], s[:, src_ids])
            untouched = [i for i in range(16) if i not in dst_ids]
            assert not d[:, untouched].any()


def test_a_block_put_over_ipc_is_served_over_tcp(store, fingerprint):
    src = random_caches(fingerprint, 8, seed=2)
    dst = [torch.zeros_like(cache) for cache in src]
    hashes = chain("cross", 3)
    with KvStoreClient(store.ipc, fingerprint) as producer:
        assert producer.put(hashes, src, [0, 1, 2]) == 3
    with KvStoreClient(store.tcp, fingerprint) as consumer:
        assert consumer.get(hashes, dst, [5, 6, 7]) == 3
    for s, d in zip(src, dst):
        assert torch.equal(d[:, 5:8], s[:, 0:3])


@pytest.mark.parametrize("via", ["ipc", "tcp"])
def test_lookup_and_get_stop_at_the_first_missing_block(store, fingerprint, via):
    address = store.ipc if via == "ipc" else store.tcp
    src = random_caches(fingerprint, 8, seed=3)
    dst = [torch.zeros_like(cache) for cache in src]
    hashes = chain(f"prefix-{via}", 5)
    with KvStoreClient(address, fingerprint) as client:
        assert client.put(hashes[:3], src, [0, 1, 2]) == 3
        assert client.put(hashes[4:], src, [4]) == 1  # held, but after a gap
        assert client.lookup(hashes) == 3
        assert client.lookup(hashes[1:]) == 2
        assert client.lookup(chain("absent", 2)) == 0
        assert client.get(hashes, dst, [3, 4, 5, 6, 7]) == 3  # a partial load
        for s, d in zip(src, dst):
            assert torch.equal(d[:, 3:6], s[:, 0:3])
            assert not d[:, 6:].any()
        # A put of a chain that is partly held stores the rest and counts the whole chain.
        assert client.put(hashes, src, [0, 1, 2, 3, 4]) == 5
        assert client.lookup(hashes) == 5


@pytest.mark.parametrize("via", ["ipc", "tcp"])
def test_a_block_is_never_served_under_another_layout(store, via):
    address = store.ipc if via == "ipc" else store.tcp
    fp = tiny_fingerprint()
    hashes = chain(f"layout-{via}", 2)
    with KvStoreClient(address, fp) as client:
        assert client.put(hashes, random_caches(fp, 4), [0, 1]) == 2
    for other in (tiny_fingerprint(tp_rank=1), tiny_fingerprint(model="other")):
        dst = [torch.zeros(2, 4, 4, 2, 8) for _ in range(2)]
        with KvStoreClient(address, other) as client:
            assert client.lookup(hashes) == 0
            assert client.get(hashes, dst, [0, 1]) == 0
        assert not any(cache.any() for cache in dst)


def test_caches_of_the_wrong_layout_are_refused(store, fingerprint):
    with KvStoreClient(store.ipc, fingerprint) as client:
        wrong = [torch.zeros(2, 4, 4, 2, 16) for _ in range(2)]
        with pytest.raises(ValueError, match="shape"):
            client.put(chain("wrong", 1), wrong, [0])
        with pytest.raises(ValueError, match="block ids"):
            client.get(chain("wrong", 2), random_caches(fingerprint, 4), [0])
