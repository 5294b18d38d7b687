"""fp8 KV caches (--kv-cache-dtype fp8_e4m3 / fp8_e5m2): every write and read path against
the torch reference.

Each batch's caches are quantized once (K / k_scale, V / v_scale, scales other than 1 so a
path that forgets one shows up); the expected output is the reference over float caches that
hold exactly the values the fp8 bytes stand for (dequantize_kv), so each path is compared
with no quantization error of its own in the comparison. Unused slots hold fp8 NaN: reading
one shows up.
"""

from __future__ import annotations

import pytest
import torch

from kvserve import kernels
from kvserve.kernels import attention, attention_cpu, attention_ref, cache, cpu
from kvserve.kernels.cache import dequantize_kv, quantize_kv
from tests.support.kernels import DEVICE, assert_close, make_paged_batch

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
K_SCALE, V_SCALE = 0.5, 2.0
# A full prefill, chunks behind a context, decodes; bf16's longer chunk (80 > 63 tokens)
# takes the flash route on an AMX CPU, whose AMX kernel declines fp8 caches.
LAYOUT = [(17, 17), (1, 29), (7, 40), (1, 1), (3, 16), (80, 100), (1, 16)]
needs_cpu_kernels = pytest.mark.skipif(
    not cpu.available(torch.float32),
    reason="the CPU kernels are not built here (no C compiler, or the build failed)",
)


def _fp8_batch(layout, fp8, dtype, num_heads=8, num_kv_heads=2, head_size=64):
    batch = make_paged_batch(layout, num_heads, num_kv_heads, head_size, 16, dtype)
    key_cache = quantize_kv(batch.key_cache, K_SCALE, fp8)
    value_cache = quantize_kv(batch.value_cache, V_SCALE, fp8)
    return batch, key_cache, value_cache


def _call(fn, batch, key_cache, value_cache, **kwargs):
    return fn(
        batch.query,
        key_cache,
        value_cache,
        batch.block_table,
        batch.query_start_loc,
        batch.seq_lens,
        batch.query.shape[2] ** -0.5,
        batch.max_query_len,
        batch.max_seq_len,
        **kwargs,
    )


def _expected(batch, key_cache, value_cache):
    dtype = batch.query.dtype
    return _call(
        attention_ref.paged_attention_ref,
        batch,
        dequantize_kv(key_cache, K_SCALE, dtype),
        dequantize_kv(value_cache, V_SCALE, dtype),
    )


def test_quantize_clamps_to_the_finite_range_and_round_trips():
    x = torch.tensor([1e6, -1e6, 3.0, -0.15625, 1e-9])
    for fp8 in FP8:
        q = quantize_kv(x, 2.0, fp8)
        assert q.dtype == fp8 and q.float().isfinite().all()
        assert q.float()[0] == torch.finfo(fp8).max and q.float()[1] == torch.finfo(fp8).min
        assert dequantize_kv(q, 2.0, torch.float32)[2] == 3.0  # 1.5 is exact in both
    # e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4 in range
    y = torch.randn(1000) * 10
    back = dequantize_kv(quantize_kv(y, 0.25, torch.float8_e4m3fn), 0.25, torch.float32)
    assert ((back - y).abs() <= y.abs() / 16 + 2**-9 * 0.25).all()


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_reads_fp8_times_its_scales(fp8, dtype):
    batch, key_cache, value_cache = _fp8_batch(LAYOUT, fp8, dtype)
    out = _call(
        attention_ref.paged_attention_ref,
        batch,
        key_cache,
        value_cache,
        k_scale=K_SCALE,
        v_scale=V_SCALE,
    )
    assert not out.isnan().any()
    torch.testing.assert_close(out, _expected(batch, key_cache, value_cache), atol=0, rtol=0)


@needs_cpu_kernels
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 24], ids=["avx512", "portable"])
def test_cpu_paths_match_reference(fp8, dtype, head_size):
    # Decodes and short chunks in the C kernel, longer chunks on torch's flash route.
    batch, key_cache, value_cache = _fp8_batch(LAYOUT, fp8, dtype, head_size=head_size)
    out = _call(
        attention_cpu.paged_attention_cpu,
        batch,
        key_cache,
        value_cache,
        k_scale=K_SCALE,
        v_scale=V_SCALE,
    )
    assert_close(out, _expected(batch, key_cache, value_cache), dtype)


@needs_cpu_kernels
@pytest.mark.parametrize("fp8", FP8)
def test_cpu_window_soft_cap_and_sinks_match_reference(fp8):
    batch, key_cache, value_cache = _fp8_batch(LAYOUT, fp8, torch.float32)
    sinks = torch.randn(batch.query.shape[1])
    options = dict(sliding_window=9, logits_soft_cap=5.0, sinks=sinks)
    out = _call(
        attention_cpu.paged_attention_cpu,
        batch,
        key_cache,
        value_cache,
        k_scale=K_SCALE,
        v_scale=V_SCALE,
        **options,
    )
    expected = _call(
        attention_ref.paged_attention_ref,
        batch,
        dequantize_kv(key_cache, K_SCALE, torch.float32),
        dequantize_kv(value_cache, V_SCALE, torch.float32),
        **options,
    )
    assert_close(out, expected, torch.float32)


@needs_cpu_kernels
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("head_size", [256, 24], ids=["avx512", "portable"])
def test_cpu_kernel_widens_every_fp8_value_exactly(fp8, head_size):
    # One key per request: the output is its value row, v_scale times every finite fp8 value.
    values = torch.arange(256, dtype=torch.uint8).view(fp8)
    values = values[values.float().isfinite()]
    rows = -(-values.numel() // head_size)
    value_cache = torch.zeros(rows * head_size, dtype=torch.uint8).view(fp8)
    value_cache[: values.numel()] = values
    value_cache = value_cache.view(rows, 1, 1, head_size)
    out = torch.empty(rows, 1, head_size)
    cpu.decode_attention(
        out,
        torch.randn(rows, 1, head_size),
        torch.zeros_like(value_cache),
        value_cache,
        torch.arange(rows, dtype=torch.int32).view(rows, 1),
        torch.ones(rows, dtype=torch.int32),
        torch.arange(rows),
        1.0,
        k_scale=3.0,
        v_scale=0.5,
    )
    assert torch.equal(out.reshape(-1)[: values.numel()], values.float() * 0.5)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_paths_store_the_same_bytes(fp8, dtype):
    # kernels.write_kv_cache (the C row copy where built) and rotary_write_kv_cache against
    # the reference's quantize-then-scatter, slots < 0 skipped.
    generator = torch.Generator().manual_seed(1)
    key, value = (torch.randn(6, 2, 16, generator=generator).to(dtype) for _ in range(2))
    slots = torch.tensor([3, -1, 7, 8, 15, 0])
    expected = [torch.zeros(4, 4, 2, 16, dtype=fp8) for _ in range(2)]
    cache.write_kv_cache_ref(
        quantize_kv(key, K_SCALE, fp8), quantize_kv(value, V_SCALE, fp8), *expected, slots
    )
    written = [torch.zeros(4, 4, 2, 16, dtype=fp8) for _ in range(2)]
    kernels.write_kv_cache(key, value, *written, slots, K_SCALE, V_SCALE)
    for got, want in zip(written, expected, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # The fused rotary write: position 0 leaves the key unrotated (cos 1, sin 0).
    cos_sin = torch.cat((torch.ones(1, 8), torch.zeros(1, 8)), dim=1)
    rotated = [torch.zeros(4, 4, 2, 16, dtype=fp8) for _ in range(2)]
    query = kernels.rotary_write_kv_cache(
        torch.zeros(6, dtype=torch.int64),
        torch.randn(6, 32).to(dtype),
        key.reshape(6, 32),
        value.reshape(6, 32),
        cos_sin,
        16,
        *rotated,
        slots,
        K_SCALE,
        V_SCALE,
    )
    assert query.shape == (6, 32)
    for got, want in zip(rotated, expected, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


# Triton's interpreter computes bf16 tl.dot wrongly (tests/kernels/test_attention.py): on CPU
# the fp8 cache is read into float32 and float16 queries.
_TRITON_DTYPES = [torch.float32, torch.float16]


@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", _TRITON_DTYPES)
def test_triton_reads_fp8_like_the_reference(fp8, dtype):
    layout = [(17, 17), (1, 29), (7, 40), (1, 1)]
    batch, key_cache, value_cache = _fp8_batch(layout, fp8, dtype, 4, 2, 16)
    expected = _expected(batch, key_cache, value_cache)
    on_device = [t.to(DEVICE) for t in (batch.query, key_cache, value_cache)]
    out = attention.paged_attention(
        on_device[0],
        on_device[1],
        on_device[2],
        batch.block_table.to(DEVICE),
        batch.query_start_loc.to(DEVICE),
        batch.seq_lens.to(DEVICE),
        16**-0.5,
        batch.max_query_len,
        batch.max_seq_len,
        k_scale=K_SCALE,
        v_scale=V_SCALE,
    )
    assert_close(out.cpu(), expected, dtype)


@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.parametrize("fp8", FP8)
def test_triton_write_copies_fp8_rows(fp8):
    key, value = (quantize_kv(torch.randn(5, 2, 16), K_SCALE, fp8) for _ in range(2))
    slots = torch.tensor([3, -1, 7, 8, 15])
    expected = [torch.zeros(4, 4, 2, 16, dtype=fp8) for _ in range(2)]
    cache.write_kv_cache_ref(key, value, *expected, slots)
    written = [torch.zeros(4, 4, 2, 16, dtype=fp8, device=DEVICE) for _ in range(2)]
    cache.write_kv_cache(key.to(DEVICE), value.to(DEVICE), *written, slots.to(DEVICE))
    for got, want in zip(written, expected, strict=True):
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
