"""Chunked local attention (Llama 4's attention_chunk_size) in every attention path: the
torch reference against dense attention written from the definition, the native CPU kernel
and the Triton kernel (Triton's interpreter on CPU) against the reference.

A query at position p sees only the keys of its own chunk, p // C * C <= t <= p. The chunk
sizes are shorter than, equal to and longer than a block; the batches hold prefills, chunks
that start mid-sequence (and mid-chunk) and decodes on both sides of chunk boundaries.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import attention, attention_cpu, attention_ref, cpu
from tests.support.kernels import (
    DEVICE,
    PagedBatch,
    assert_close,
    dense_causal_attention,
    make_paged_batch,
)

BLOCK_SIZE = 16
# (query_len, seq_len) per request.
MIXED = [(17, 40), (1, 29), (7, 40), (1, 1), (3, 16), (1, 45), (1, 7), (12, 12), (5, 33)]
DECODES = [(1, 1), (1, 15), (1, 16), (1, 17), (1, 45), (1, 48), (1, 49)]
CHUNK_SIZES = [6, 16, 21]


def _run(fn, batch: PagedBatch, scale: float, chunk_size, sliding_window=None, soft_cap=None):
    return fn(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_table,
        batch.query_start_loc,
        batch.seq_lens,
        scale,
        batch.max_query_len,
        batch.max_seq_len,
        sliding_window,
        soft_cap,
        chunk_size,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", [MIXED, DECODES], ids=["mixed", "decodes"])
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_reference_matches_dense(dtype, layout, chunk_size):
    batch = make_paged_batch(layout, 6, 2, 16, BLOCK_SIZE, dtype)
    out = _run(attention_ref.paged_attention_ref, batch, 0.5, chunk_size)
    assert not out.isnan().any()
    assert_close(out, dense_causal_attention(batch, 0.5, chunk_size=chunk_size), dtype)
    # The mask must matter: the batch has queries past their first chunk.
    assert not torch.allclose(out.double(), dense_causal_attention(batch, 0.5), atol=1e-2)


def test_reference_chunks_with_a_window_and_soft_cap():
    batch = make_paged_batch(MIXED, 6, 2, 16, BLOCK_SIZE, torch.float32)
    out = _run(attention_ref.paged_attention_ref, batch, 0.5, 8, 5, 2.0)
    expected = dense_causal_attention(batch, 0.5, 5, 2.0, chunk_size=8)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("layout", [MIXED, DECODES], ids=["mixed", "decodes"])
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_cpu_kernel_matches_reference(dtype, atol, layout, chunk_size):
    if not cpu.available(dtype):
        pytest.skip("no C compiler here: the CPU path is the torch reference itself")
    # Head size 64: the C kernel's specialized body (16 takes the generic one, below).
    batch = make_paged_batch(layout, 6, 2, 64, BLOCK_SIZE, dtype, seed=1)
    got = _run(attention_cpu.paged_attention_cpu, batch, 0.2, chunk_size)
    expected = _run(attention_ref.paged_attention_ref, batch, 0.2, chunk_size)
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=atol)
    plain = _run(attention_ref.paged_attention_ref, batch, 0.2, None)
    assert not torch.allclose(got.float(), plain.float(), atol=1e-2)


def test_cpu_kernel_generic_head_size_and_window():
    if not cpu.available(torch.float32):
        pytest.skip("no C compiler here: the CPU path is the torch reference itself")
    batch = make_paged_batch(MIXED, 6, 3, 16, BLOCK_SIZE, torch.float32, seed=2)
    got = _run(attention_cpu.paged_attention_cpu, batch, 0.3, 8, 5)
    expected = dense_causal_attention(batch, 0.3, 5, chunk_size=8)
    assert_close(got, expected, torch.float32)


@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.parametrize("layout", [MIXED, DECODES], ids=["mixed", "decodes"])
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_triton_kernel_matches_reference(layout, chunk_size):
    batch = make_paged_batch(layout, 6, 2, 32, BLOCK_SIZE, torch.float32)
    tensors = (
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_table,
        batch.query_start_loc,
        batch.seq_lens,
    )
    on_device = [t.to(DEVICE) for t in tensors]
    out = attention.paged_attention(
        *on_device, 0.3, batch.max_query_len, batch.max_seq_len, None, None, chunk_size
    )
    expected = _run(attention_ref.paged_attention_ref, batch, 0.3, chunk_size)
    assert_close(out.cpu(), expected, torch.float32)
