"""fp8 KV caches (--kv-cache-dtype) in the KV store: blocks move bit for bit, and a store keyed
by an fp8 layout never hands its blocks to a float cache, nor the other way (the pool is the
fingerprint's key, which covers the dtype)."""

from __future__ import annotations

import pytest
import torch

from kvserve.services.kv_store.blocks import copy_blocks_to_slots, copy_slots_to_blocks
from kvserve.services.kv_store.transfers import KVBlockTransfer
from kvserve.services.kv_store.worker_connector import StoreWorkerConnector
from kvserve.shared.config import KVTransferConfig
from tests.support.kv_store import random_caches, tiny_fingerprint

FP8 = ["float8_e4m3fn", "float8_e5m2"]


def _config(folder) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="SharedStorageConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": str(folder)},
    )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_blocks_round_trip_bit_equal_and_take_half_the_bytes(tmp_path, dtype):
    fp = tiny_fingerprint(dtype, block_size=4)
    assert 2 * fp.block_bytes == tiny_fingerprint("bfloat16", block_size=4).block_bytes
    caches = random_caches(fp, 8, seed=3)
    StoreWorkerConnector(_config(tmp_path), fp, caches).save(
        [KVBlockTransfer("a", [bytes([i]) * 16 for i in range(3)], [5, 6, 7])]
    )
    others = [torch.zeros_like(c) for c in caches]
    loader = StoreWorkerConnector(_config(tmp_path), fp, others)
    hashes = [bytes([i]) * 16 for i in range(3)]
    assert loader.load([KVBlockTransfer("a", hashes, [1, 2, 3])]) == {"a": 3}
    for src, dst in zip(caches, others, strict=True):
        assert torch.equal(_bytes(dst[:, 1:4]), _bytes(src[:, 5:8]))


@pytest.mark.parametrize(
    "saved, loaded",
    [("bfloat16", "float8_e4m3fn"), ("float8_e4m3fn", "float8_e5m2"), ("float8_e5m2", "bfloat16")],
)
def test_blocks_never_cross_kv_dtypes(tmp_path, saved, loaded):
    hashes = [bytes([i]) * 16 for i in range(2)]
    fp_saved = tiny_fingerprint(saved, block_size=4)
    StoreWorkerConnector(_config(tmp_path), fp_saved, random_caches(fp_saved, 4)).save(
        [KVBlockTransfer("a", hashes, [0, 1])]
    )
    fp_loaded = tiny_fingerprint(loaded, block_size=4)
    loader = StoreWorkerConnector(_config(tmp_path), fp_loaded, random_caches(fp_loaded, 4))
    assert loader.load([KVBlockTransfer("a", hashes, [2, 3])]) == {"a": 0}


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_copies_through_a_slots_view_are_exact(dtype):
    fp = tiny_fingerprint(dtype)
    src = random_caches(fp, 10, seed=4)
    dst = [torch.zeros_like(cache) for cache in src]
    view = torch.zeros(12, fp.num_layers, 2, fp.block_elements, dtype=getattr(torch, dtype))
    src_ids, dst_ids, slots = [9, 0, 3, 4, 8, 1], [0, 1, 2, 5, 6, 9], [11, 0, 9, 4, 2, 7]
    copy_blocks_to_slots(src, src_ids, view, slots)
    copy_slots_to_blocks(view, slots, dst, dst_ids)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(_bytes(d[:, dst_ids]), _bytes(s[:, src_ids]))
