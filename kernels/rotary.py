"""Rotary position embedding, neox (rotate-half) style.

Each head of size D splits into halves x1 = x[:D/2], x2 = x[D/2:], rotated by the angle of the
token's position:

    out[:D/2] = x1 * cos - x2 * sin
    out[D/2:] = x2 * cos + x1 * sin

cos_sin_cache is [max_position, D] float32: cos in columns [0, D/2), sin in [D/2, D). Both
implementations read the two halves straight from that layout (no cat into full-width cos/sin),
compute in float32 and round once.
"""

from __future__ import annotations

import torch

from kvserve.kernels._triton import HAS_TRITON, next_power_of_2, require_triton, tl, triton

if HAS_TRITON:

    @triton.jit
    def _rotate_heads(
        x_ptr,
        out_ptr,
        num_heads,
        cos,
        sin,
        HEAD_SIZE: tl.constexpr,
        BLOCK_HEADS: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
    ):
        # Rotate all heads of one token: a [BLOCK_HEADS, BLOCK_HALF] tile per half.
        heads = tl.arange(0, BLOCK_HEADS)
        half_cols = tl.arange(0, BLOCK_HALF)
        mask = (heads[:, None] < num_heads) & (half_cols[None, :] < HEAD_SIZE // 2)
        offsets = heads[:, None] * HEAD_SIZE + half_cols[None, :]
        x1 = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + offsets + HEAD_SIZE // 2, mask=mask, other=0.0).to(tl.float32)
        out1 = x1 * cos[None, :] - x2 * sin[None, :]
        out2 = x2 * cos[None, :] + x1 * sin[None, :]
        out_dtype = out_ptr.dtype.element_ty
        tl.store(out_ptr + offsets, out1.to(out_dtype), mask=mask)
        tl.store(out_ptr + offsets + HEAD_SIZE // 2, out2.to(out_dtype), mask=mask)

    @triton.jit
    def _rotary_embedding_kernel(
        positions_ptr,
        query_ptr,
        key_ptr,
        cos_sin_ptr,
        query_out_ptr,
        key_out_ptr,
        query_token_stride,
        key_token_stride,
        cos_sin_stride,
        num_query_heads,
        num_kv_heads,
        HEAD_SIZE: tl.constexpr,
        BLOCK_QUERY_HEADS: tl.constexpr,
        BLOCK_KV_HEADS: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
    ):
        # One program per token: load its cos/sin once, rotate its query and key heads.
        token = tl.program_id(0).to(tl.int64)
        position = tl.load(positions_ptr + token).to(tl.int64)
        half_cols = tl.arange(0, BLOCK_HALF)
        half_mask = half_cols < HEAD_SIZE // 2
        cos_ptr = cos_sin_ptr + position * cos_sin_stride + half_cols
        cos = tl.load(cos_ptr, mask=half_mask, other=0.0).to(tl.float32)
        sin = tl.load(cos_ptr + HEAD_SIZE // 2, mask=half_mask, other=0.0).to(tl.float32)
        _rotate_heads(
            query_ptr + token * query_token_stride,
            query_out_ptr + token * num_query_heads * HEAD_SIZE,
            num_query_heads,
            cos,
            sin,
            HEAD_SIZE,
            BLOCK_QUERY_HEADS,
            BLOCK_HALF,
        )
        _rotate_heads(
            key_ptr + token * key_token_stride,
            key_out_ptr + token * num_kv_heads * HEAD_SIZE,
            num_kv_heads,
            cos,
            sin,
            HEAD_SIZE,
            BLOCK_KV_HEADS,
            BLOCK_HALF,
        )


def _check_rotary_args(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
) -> None:
    num_tokens = positions.shape[0]
    assert head_size % 2 == 0, f"head_size must be even, got {head_size}"
    for name, x in (("query", query), ("key", key)):
        assert x.dim() == 2 and x.shape[0] == num_tokens, f"{name} must be [T, H*D]: {x.shape}"
        assert x.shape[1] % head_size == 0, f"{name} width {x.shape[1]} % {head_size} != 0"
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_size, (
        f"cos_sin_cache must be [max_position, {head_size}], got {cos_sin_cache.shape}"
    )


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton rotary embedding; query/key rows may be strided (slices of a fused qkv output).

    Args:
        positions: [T] int64 token positions.
        query: [T, Hq * D], last dim contiguous.
        key: [T, Hkv * D], last dim contiguous.
        cos_sin_cache: [max_position, D] float32, cos | sin.
        head_size: D.
    Returns:
        New contiguous (query, key), rotated, same dtype.
    """
    require_triton("rotary_embedding")
    _check_rotary_args(positions, query, key, cos_sin_cache, head_size)
    assert query.stride(1) == 1 and key.stride(1) == 1, "query/key last dim must be contiguous"
    assert cos_sin_cache.stride(1) == 1 and positions.is_contiguous()
    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    key_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return query_out, key_out
    num_query_heads = query.shape[1] // head_size
    num_kv_heads = key.shape[1] // head_size
    _rotary_embedding_kernel[(num_tokens,)](
        positions,
        query,
        key,
        cos_sin_cache,
        query_out,
        key_out,
        query.stride(0),
        key.stride(0),
        cos_sin_cache.stride(0),
        num_query_heads,
        num_kv_heads,
        HEAD_SIZE=head_size,
        BLOCK_QUERY_HEADS=next_power_of_2(num_query_heads),
        BLOCK_KV_HEADS=next_power_of_2(num_kv_heads),
        BLOCK_HALF=next_power_of_2(head_size // 2),
    )
    return query_out, key_out


def _rotate_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int
) -> torch.Tensor:
    # x: [T, H * D]; cos, sin: [T, 1, D/2] float32 (broadcast over heads).
    num_tokens, half = x.shape[0], head_size // 2
    x_heads = x.view(num_tokens, -1, head_size).float()
    x1, x2 = x_heads[..., :half], x_heads[..., half:]
    # Write both halves into one float32 buffer: no cat, no full-width cos/sin.
    out = torch.empty(x_heads.shape, dtype=torch.float32, device=x.device)
    out1, out2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=out1)
    out1.addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=out2)
    out2.addcmul_(x1, sin)
    return out.view(num_tokens, -1).to(x.dtype)


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch rotary embedding; same contract as `rotary_embedding`."""
    _check_rotary_args(positions, query, key, cos_sin_cache, head_size)
    half = head_size // 2
    cos_sin = cos_sin_cache.index_select(0, positions).float().unsqueeze(1)  # [T, 1, D]
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]
    return _rotate_ref(query, cos, sin, head_size), _rotate_ref(key, cos, sin, head_size)
