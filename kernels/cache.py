"""Write K/V into the paged cache at slot_mapping."""

import torch


def write_kv_cache_ref(key, value, key_cache, value_cache, slot_mapping):
    num_blocks, block_size = key_cache.shape[:2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    key_cache.view(num_blocks * block_size, *key_cache.shape[2:])[slots] = key[valid]
    value_cache.view(num_blocks * block_size, *value_cache.shape[2:])[slots] = value[valid]


write_kv_cache = write_kv_cache_ref  # replaced by the Triton kernel
