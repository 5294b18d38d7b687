"""Write this step's K/V into the paged cache at slot_mapping.

    slot = block_id * block_size + offset_in_block;  slot < 0 means "do not write" (a padded
    token, or one whose KV is not kept).

The cache is [num_blocks, block_size, Hkv, D] and contiguous, so slot s is the s-th run of
Hkv * D elements of the flattened cache.

An fp8 cache (--kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2: torch.float8_e4m3fn or
torch.float8_e5m2) holds K / k_scale and V / v_scale rounded to 8 bits (`quantize_kv`, before
the copy: every write path copies bytes of the cache's dtype); every read path multiplies
back (`dequantize_kv` in the torch routes, in registers in the C and Triton kernels).
"""

from __future__ import annotations

import torch

from kvserve.kernels._triton import HAS_TRITON, next_power_of_2, require_triton, tl, triton

# The KV dtypes of --kv-cache-dtype besides the model's own (`auto`).
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype holds scaled 8-bit floats (kernels multiply back)."""
    return dtype in FP8_KV_DTYPES


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in the fp8 `dtype`, clamped to its finite range first: torch's cast
    saturates e4m3fn (+-448) but would turn an e5m2 overflow into inf."""
    finfo = torch.finfo(dtype)
    scaled = x.float() if scale == 1.0 else x.float() / scale
    return torch.clamp(scaled, finfo.min, finfo.max).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows read back as `dtype`: fp8 values times their scale; others as they are."""
    if not is_fp8(x.dtype):
        return x
    if scale == 1.0:
        return x.to(dtype)  # exact: every fp8 value is a bfloat16 and a float32
    return x.float().mul_(scale).to(dtype)


if HAS_TRITON:

    @triton.jit
    def _write_kv_cache_kernel(
        key_ptr,
        value_ptr,
        key_cache_ptr,
        value_cache_ptr,
        slot_mapping_ptr,
        key_token_stride,
        value_token_stride,
        token_size,
        BLOCK_SIZE: tl.constexpr,
    ):
        # One program per token: copy its Hkv * D keys and values to its slot.
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot < 0:
            return
        offsets = tl.arange(0, BLOCK_SIZE)
        mask = offsets < token_size
        key = tl.load(key_ptr + token * key_token_stride + offsets, mask=mask)
        value = tl.load(value_ptr + token * value_token_stride + offsets, mask=mask)
        tl.store(key_cache_ptr + slot * token_size + offsets, key, mask=mask)
        tl.store(value_cache_ptr + slot * token_size + offsets, value, mask=mask)


def _check_kv_cache_args(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    assert key.dim() == 3 and key.shape == value.shape, (key.shape, value.shape)
    assert key_cache.dim() == 4 and key_cache.shape == value_cache.shape, key_cache.shape
    assert key.shape[1:] == key_cache.shape[2:], (
        f"key heads/head_size {tuple(key.shape[1:])} != cache {tuple(key_cache.shape[2:])}"
    )
    assert slot_mapping.shape == (key.shape[0],), (slot_mapping.shape, key.shape)
    assert key.dtype == key_cache.dtype and value.dtype == value_cache.dtype, (
        f"K/V dtype {key.dtype} must match the cache dtype {key_cache.dtype}"
    )


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton scatter of K/V into the paged cache, in place.

    Args:
        key, value: [T, Hkv, D]; token rows may be strided (views of a fused qkv output) but
            each token's Hkv * D values must be contiguous.
        key_cache, value_cache: [num_blocks, block_size, Hkv, D], contiguous.
        slot_mapping: [T] int64; a slot < 0 is skipped.
    """
    require_triton("write_kv_cache")
    _check_kv_cache_args(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_size = key.shape
    for x in (key, value):
        assert x.stride(2) == 1 and x.stride(1) == head_size, f"token rows not packed: {x.stride()}"
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    assert slot_mapping.is_contiguous()
    if num_tokens == 0:
        return
    token_size = num_kv_heads * head_size
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        token_size,
        BLOCK_SIZE=next_power_of_2(token_size),
    )


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Torch scatter of K/V into the paged cache, in place; same contract as `write_kv_cache`."""
    _check_kv_cache_args(key, value, key_cache, value_cache, slot_mapping)
    num_blocks, block_size = key_cache.shape[:2]
    slots = slot_mapping.long()  # index_copy_ wants int64; a no-op for the contract's dtype
    # The common step writes every token: test first, compact only when some slot is < 0.
    if bool((slots < 0).any()):
        kept = (slots >= 0).nonzero().squeeze(1)
        slots, key, value = slots[kept], key[kept], value[kept]
    if is_fp8(key_cache.dtype):  # torch has no index_copy_ for fp8: copy the bytes
        key, value = key.view(torch.uint8), value.view(torch.uint8)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    # index_copy_ on the flat [num_slots, Hkv, D] view: a straight row copy, no index-put.
    key_cache.view(num_blocks * block_size, *key_cache.shape[2:]).index_copy_(0, slots, key)
    value_cache.view(num_blocks * block_size, *value_cache.shape[2:]).index_copy_(0, slots, value)
