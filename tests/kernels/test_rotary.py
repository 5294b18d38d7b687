"""Rotary embedding (neox): the reference against the rotation it encodes, the Triton kernel
against the reference."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import rotary
from tests.support.kernels import DEVICE, assert_close


def _cos_sin_cache(max_position: int, head_size: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


def _rotate_formula(
    x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, head_size: int
) -> torch.Tensor:
    # Each (x[i], x[i + D/2]) pair turns by the angle of (position, i): a 2-D rotation.
    half = head_size // 2
    heads = x.double().view(x.shape[0], -1, head_size)
    cos = cache[positions, :half].double()[:, None, :]
    sin = cache[positions, half:].double()[:, None, :]
    first, second = heads[..., :half], heads[..., half:]
    rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return rotated.view(x.shape[0], -1)


def _qkv_views(num_tokens, num_heads, num_kv_heads, head_size, dtype, device="cpu"):
    # query and key are strided slices of one fused qkv output, as the model produces them.
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size).to(device, dtype)
    return qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_ref_matches_formula(dtype):
    head_size = 64
    cache = _cos_sin_cache(512, head_size, base=100000.0)
    positions = torch.tensor([0, 1, 17, 300, 511, 5])
    query, key = _qkv_views(6, 9, 3, head_size, dtype)
    out_query, out_key = rotary.rotary_embedding_ref(positions, query, key, cache, head_size)
    assert_close(out_query, _rotate_formula(query, positions, cache, head_size), dtype)
    assert_close(out_key, _rotate_formula(key, positions, cache, head_size), dtype)


def test_rotary_ref_keeps_norm_and_position_zero():
    # A rotation keeps each pair's length; position 0 is the identity.
    cache = _cos_sin_cache(64, 32)
    query, key = _qkv_views(3, 2, 1, 32, torch.float32)
    positions = torch.tensor([0, 7, 63])
    out_query, _ = rotary.rotary_embedding_ref(positions, query, key, cache, 32)
    assert_close(out_query[0], query[0], torch.float32)
    pair_norm = lambda x: x.view(3, 2, 2, 16).pow(2).sum(2)  # noqa: E731
    assert_close(pair_norm(out_query), pair_norm(query), torch.float32)


@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(4, 4, 32), (9, 3, 64), (6, 2, 40)])
def test_rotary_triton_matches_ref(dtype, num_heads, num_kv_heads, head_size):
    num_tokens = 5
    cache = _cos_sin_cache(128, head_size).to(DEVICE)
    positions = torch.tensor([3, 0, 127, 64, 9], device=DEVICE)
    query, key = _qkv_views(num_tokens, num_heads, num_kv_heads, head_size, dtype, DEVICE)
    out_query, out_key = rotary.rotary_embedding(positions, query, key, cache, head_size)
    ref_query, ref_key = rotary.rotary_embedding_ref(positions, query, key, cache, head_size)
    assert_close(out_query, ref_query, dtype)
    assert_close(out_key, ref_key, dtype)
