"""write_kv_cache: slots land where slot_mapping says, slot < 0 writes nothing, and the Triton
kernel leaves exactly the cache the reference leaves."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import cache
from tests.support.kernels import DEVICE

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE = 6, 16, 2, 8


def _inputs(num_tokens: int, dtype: torch.dtype, device="cpu"):
    generator = torch.Generator().manual_seed(num_tokens)
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    key_cache = torch.randn(cache_shape, generator=generator).to(device, dtype)
    value_cache = torch.randn(cache_shape, generator=generator).to(device, dtype)
    # key/value are strided views of one fused qkv-like buffer, as the model produces them.
    kv = torch.randn(num_tokens, 3, NUM_KV_HEADS, HEAD_SIZE, generator=generator)
    kv = kv.to(device, dtype)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=generator)[:num_tokens]
    slots[1::3] = -1  # padded tokens: nothing written
    return kv[:, 1], kv[:, 2], key_cache, value_cache, slots.to(device)


def _expected_cache(cache_before, rows, slots):
    expected = cache_before.clone().view(NUM_BLOCKS * BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot] = rows[token]
    return expected.view(cache_before.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_ref_writes_slots_and_skips_negative(dtype):
    key, value, key_cache, value_cache, slots = _inputs(10, dtype)
    expected_keys = _expected_cache(key_cache, key, slots)
    expected_values = _expected_cache(value_cache, value, slots)
    cache.write_kv_cache_ref(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_keys)
    assert torch.equal(value_cache, expected_values)


def test_write_kv_cache_ref_all_slots_valid():
    key, value, key_cache, value_cache, slots = _inputs(5, torch.float32)
    slots = torch.tensor([0, 17, 95, 3, 40])
    expected_keys = _expected_cache(key_cache, key, slots)
    cache.write_kv_cache_ref(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_keys)
    # Slot 17 is block 1, offset 1.
    assert torch.equal(key_cache[1, 1], key[1])


@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 20])
def test_write_kv_cache_triton_matches_ref(dtype, num_tokens):
    key, value, key_cache, value_cache, slots = _inputs(num_tokens, dtype, DEVICE)
    ref_key_cache, ref_value_cache = key_cache.clone(), value_cache.clone()
    cache.write_kv_cache(key, value, key_cache, value_cache, slots)
    cache.write_kv_cache_ref(key, value, ref_key_cache, ref_value_cache, slots)
    # A copy is exact: bitwise equality, including the untouched slots.
    assert torch.equal(key_cache, ref_key_cache)
    assert torch.equal(value_cache, ref_value_cache)
