"""The native CPU RMSNorm, SiLU-and-mul, rotary and argmax kernels against their torch
references.

bfloat16 must round like the references (a handful of last-bit differences at most, from a
different summation order); float32 must agree to float rounding.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import cpu, dispatch
from kvserve.kernels.activation import silu_and_mul_ref
from kvserve.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from kvserve.kernels.rotary import rotary_embedding_ref

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _needs_compiler():
    if not cpu.available(torch.float32):
        pytest.skip("no C compiler here: the CPU ops are the torch references themselves")


def _assert_matches(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    else:
        # Equal up to one bfloat16 step on at most 1% of the values.
        diff = (got.float() - expected.float()).abs()
        step = expected.float().abs().clamp_min(1e-3) * 2**-7
        assert bool((diff <= step).all()), f"max diff {diff.max().item()}"
        assert (got != expected).sum().item() <= 0.01 * got.numel()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 300])
def test_rms_norm_and_fused_add(dtype, num_tokens):
    torch.manual_seed(num_tokens)
    # x as a strided view (rows of a wider buffer), as a residual stream slice may be.
    x = torch.randn(num_tokens, 640).to(dtype)[:, :576]
    residual = torch.randn(num_tokens, 576).to(dtype)
    weight = torch.randn(576).to(dtype)
    _assert_matches(dispatch.rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5))
    out, residual_out = dispatch.fused_add_rms_norm(x, residual, weight, 1e-5)
    expected_out, expected_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    torch.testing.assert_close(residual_out, expected_residual, atol=0, rtol=0)
    _assert_matches(out, expected_out)
    assert x.shape == (num_tokens, 576)  # inputs untouched, outputs fresh


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 5, 200])
def test_silu_and_mul(dtype, num_tokens):
    torch.manual_seed(num_tokens)
    x = (torch.randn(num_tokens, 2 * 1536) * 6).to(dtype)  # reaches exp's far ranges
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    _assert_matches(dispatch.silu_and_mul(x), silu_and_mul_ref(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 15, 17, 100])
def test_row_widths_that_are_not_whole_vectors(dtype, width):
    """The AVX-512 loops take rows 16 lanes at a time and a row's tail under a mask: widths
    below, around and between multiples of 16, from strided input rows."""
    torch.manual_seed(width)
    x = torch.randn(3, width + 5).to(dtype)[:, :width]
    residual = torch.randn(3, width).to(dtype)
    weight = torch.randn(width)
    _assert_matches(dispatch.rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))
    out, residual_out = dispatch.fused_add_rms_norm(x, residual, weight, 1e-6)
    expected_out, expected_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    torch.testing.assert_close(residual_out, expected_residual, atol=0, rtol=0)
    _assert_matches(out, expected_out)
    gate_up = (torch.randn(3, 2 * width) * 4).to(dtype)
    _assert_matches(dispatch.silu_and_mul(gate_up), silu_and_mul_ref(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 9, 150])
def test_rotary_embedding_on_a_fused_qkv_split(dtype, num_tokens):
    torch.manual_seed(num_tokens)
    num_heads, num_kv_heads, head_size = 9, 3, 64
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size).to(dtype)
    query, key, _ = qkv.split(
        [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], dim=-1
    )
    positions = torch.randint(0, 4096, (num_tokens,))
    freqs = torch.outer(torch.arange(4096).float(), 1e-4 ** (torch.arange(32) / 32))
    cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    got_q, got_k = dispatch.rotary_embedding(positions, query, key, cos_sin_cache, head_size)
    expected_q, expected_k = rotary_embedding_ref(positions, query, key, cos_sin_cache, head_size)
    _assert_matches(got_q, expected_q)
    _assert_matches(got_k, expected_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 7, 700])
def test_write_kv_cache_rows_of_a_fused_qkv(dtype, num_tokens):
    """The C KV write: strided key / value rows (views of a fused qkv) to their slots, a slot
    of -1 skipped, every other slot untouched; the same bytes as the reference's."""
    from kvserve.kernels.cache import write_kv_cache_ref

    torch.manual_seed(num_tokens)
    num_kv_heads, head_size, block_size, num_blocks = 3, 64, 16, 64
    qkv = torch.randn(num_tokens, (9 + 2 * num_kv_heads) * head_size).to(dtype)
    key = qkv[:, 9 * head_size : 12 * head_size].view(num_tokens, num_kv_heads, head_size)
    value = qkv[:, 12 * head_size :].view(num_tokens, num_kv_heads, head_size)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[0] = -1
    caches = [torch.randn(2, num_blocks, block_size, num_kv_heads, head_size).to(dtype)]
    caches.append(caches[0].clone())
    assert cpu.write_kv_cache(key, value, caches[0][0], caches[0][1], slots)
    write_kv_cache_ref(key, value, caches[1][0], caches[1][1], slots)
    assert torch.equal(caches[0], caches[1])


def test_write_kv_cache_falls_back_on_caches_it_does_not_copy_into():
    # A strided cache view (not the engine's layout): the C call declines and dispatch takes
    # the reference, which writes the same slots.
    from kvserve.kernels.cache import write_kv_cache_ref

    torch.manual_seed(0)
    key, value = torch.randn(5, 3, 64), torch.randn(5, 3, 64)
    wide = torch.zeros(2, 8, 16, 6, 64)
    key_cache, value_cache = wide[0, :, :, :3], wide[1, :, :, :3]
    slots = torch.tensor([3, 17, -1, 40, 0])
    assert not cpu.write_kv_cache(key, value, key_cache, value_cache, slots)
    expected = wide.clone()
    write_kv_cache_ref(key, value, expected[0, :, :, :3], expected[1, :, :, :3], slots)
    dispatch.write_kv_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(wide, expected) and bool(wide.abs().sum() > 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 15, 16, 17, 100, 49152])
def test_argmax_picks_torchs_index(dtype, width):
    # The greedy sampler's pick must be torch's exactly: random rows, ties (the first of the
    # equal maxima), a NaN (the first NaN wins), rows of -inf, rows strided in a wider buffer.
    torch.manual_seed(width)
    wide = torch.randn(9, width + 7).to(dtype)
    rows = wide[:, :width]  # row stride width + 7
    rows[1] = 0.5  # every entry tied
    rows[2, width // 2 :] = 3.0  # a tie at the top, from the middle on
    rows[3] = float("-inf")
    if width > 2:
        rows[4, width - 1] = float("nan")
        rows[5, 1] = float("nan")
        rows[5, width - 1] = float("nan")
        rows[6, width // 3] = float("inf")
        rows[6, width - 1] = float("inf")
    got = dispatch.argmax(rows)
    assert got.dtype == torch.int64 and torch.equal(got, rows.argmax(dim=-1)), (got, width)
    assert torch.equal(cpu.argmax(rows.contiguous()), rows.argmax(dim=-1))


def test_argmax_takes_torchs_path_for_other_layouts():
    x = torch.randn(4, 8)
    assert cpu.argmax(x.t()) is None  # columns are not contiguous
    assert torch.equal(dispatch.argmax(x.t()), x.t().argmax(dim=-1))
    assert torch.equal(dispatch.argmax(x[0]), x[0].argmax(dim=-1))  # 1-D


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 9, 300])
def test_rotary_write_kv_cache_is_the_two_ops_bit_for_bit(dtype, num_tokens):
    """RoPE fused with the KV write: the same rotated query and the same cache bytes as the
    rotary kernel followed by the KV write (a slot of -1 written nowhere, every other slot
    untouched); through dispatch, from views of a fused qkv."""
    torch.manual_seed(num_tokens)
    num_heads, num_kv_heads, head_size, block_size, num_blocks = 9, 3, 64, 16, 32
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size).to(dtype)
    query, key, value = qkv.split(
        [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], dim=-1
    )
    positions = torch.randint(0, 4096, (num_tokens,))
    freqs = torch.outer(torch.arange(4096).float(), 1e-4 ** (torch.arange(32) / 32))
    cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[0] = -1
    fused = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size).to(dtype)
    apart = fused.clone()

    rotated = dispatch.rotary_write_kv_cache(
        positions, query, key, value, cos_sin_cache, head_size, fused[0], fused[1], slots
    )
    expected_q, expected_k = cpu.rotary_embedding(positions, query, key, cos_sin_cache, head_size)
    shape = (num_tokens, num_kv_heads, head_size)
    assert cpu.write_kv_cache(expected_k.view(shape), value.view(shape), apart[0], apart[1], slots)
    assert torch.equal(rotated, expected_q) and rotated.is_contiguous()
    assert torch.equal(fused, apart)
    _assert_matches(rotated, rotary_embedding_ref(positions, query, key, cos_sin_cache, 64)[0])


def test_rotary_write_kv_cache_falls_back_on_caches_it_does_not_write():
    # Strided cache views: the C pass declines, dispatch runs rotary then the KV write.
    from kvserve.kernels.cache import write_kv_cache_ref

    torch.manual_seed(0)
    query, key, value = torch.randn(5, 128), torch.randn(5, 64), torch.randn(5, 64)
    positions = torch.tensor([0, 3, 9, 2, 7])
    freqs = torch.outer(torch.arange(16).float(), 1e-4 ** (torch.arange(32) / 32))
    cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    wide = torch.zeros(2, 8, 16, 2, 64)
    key_cache, value_cache = wide[0, :, :, :1], wide[1, :, :, :1]
    slots = torch.tensor([3, 17, -1, 40, 0])
    args = (positions, query, key, value, cos_sin_cache, 64, key_cache, value_cache, slots)
    assert cpu.rotary_write_kv_cache(*args) is None
    expected = wide.clone()
    expected_q, expected_k = rotary_embedding_ref(positions, query, key, cos_sin_cache, 64)
    write_kv_cache_ref(
        expected_k.view(5, 1, 64),
        value.view(5, 1, 64),
        expected[0, :, :, :1],
        expected[1, :, :, :1],
        slots,
    )
    _assert_matches(dispatch.rotary_write_kv_cache(*args), expected_q)
    torch.testing.assert_close(wide, expected, atol=1e-5, rtol=1e-5)
    assert bool(wide.abs().sum() > 0)
