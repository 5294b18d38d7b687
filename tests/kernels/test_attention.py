"""Paged attention: the reference against dense causal attention on contiguous K/V, the
Triton kernel against the reference.

Batches mix the cases the scheduler produces: a full prefill, a prefill chunk that starts
mid-sequence, decodes, lengths on and off block boundaries; unused cache slots hold NaN, so
reading one (or failing to mask it) shows up.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.kernels import attention, attention_ref
from tests.support.kernels import (
    DEVICE,
    PagedBatch,
    assert_close,
    dense_causal_attention,
    make_paged_batch,
)

BLOCK_SIZE = 16

# (query_len, seq_len) per request.
MIXED = [(17, 17), (1, 29), (7, 40), (1, 1), (3, 16), (1, 16)]
DECODES = [(1, 1), (1, 15), (1, 16), (1, 17), (1, 45)]
# Similar lengths (4, 4 and 3 blocks) in non-increasing order: one decode group in request
# order, the reference's fast path.
UNIFORM_DECODES = [(1, 64), (1, 50), (1, 40)]
PREFILL_CHUNKS = [(20, 20), (16, 48), (5, 5)]


def _run(
    fn, batch: PagedBatch, scale: float, sliding_window=None, soft_cap=None, sinks=None
) -> torch.Tensor:
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
        sinks=sinks,
    )


def _to_device(batch: PagedBatch) -> PagedBatch:
    tensors = {
        field.name: getattr(batch, field.name).to(DEVICE)
        for field in dataclasses.fields(batch)
        if isinstance(getattr(batch, field.name), torch.Tensor)
    }
    return dataclasses.replace(batch, **tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "layout",
    [MIXED, DECODES, UNIFORM_DECODES, PREFILL_CHUNKS],
    ids=["mixed", "decodes", "uniform_decodes", "prefills"],
)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(4, 4, 16), (9, 3, 64), (8, 1, 32)])
def test_paged_attention_ref_matches_dense(dtype, layout, num_heads, num_kv_heads, head_size):
    batch = make_paged_batch(layout, num_heads, num_kv_heads, head_size, BLOCK_SIZE, dtype)
    scale = head_size**-0.5
    out = _run(attention_ref.paged_attention_ref, batch, scale)
    assert out.shape == batch.query.shape and not out.isnan().any()
    assert_close(out, dense_causal_attention(batch, scale), dtype)


def test_paged_attention_ref_decode_groups_split_by_budget(monkeypatch):
    # A budget below one request's K/V puts every decode in a group of its own.
    monkeypatch.setattr(attention_ref, "_DECODE_GROUP_BYTES", 1)
    batch = make_paged_batch(UNIFORM_DECODES + MIXED, 4, 2, 16, BLOCK_SIZE, torch.float32)
    out = _run(attention_ref.paged_attention_ref, batch, 0.25)
    assert_close(out, dense_causal_attention(batch, 0.25), torch.float32)


def test_paged_attention_ref_sees_only_its_past():
    # Changing a key after query j's position must not change query j's output.
    batch = make_paged_batch([(6, 10)], 2, 1, 16, BLOCK_SIZE, torch.float32)
    before = _run(attention_ref.paged_attention_ref, batch, 0.25)
    block_id = int(batch.block_table[0, 0])
    batch.key_cache[block_id, 9] += 5.0  # position 9: only the last query sees it
    after = _run(attention_ref.paged_attention_ref, batch, 0.25)
    assert torch.equal(before[:5], after[:5])
    assert not torch.allclose(before[5], after[5])


# Triton 3.9's interpreter computes tl.dot on bf16 operands wrongly (a 16x16 bf16 dot is off
# by 1e10); fp16 takes the same low-precision path there, bf16 runs compiled on a GPU.
_BF16_DOT_BROKEN = pytest.mark.skipif(
    DEVICE.type == "cpu", reason="bf16 tl.dot is wrong in the Triton interpreter"
)
TRITON_DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=_BF16_DOT_BROKEN)]


@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("layout", [MIXED, DECODES], ids=["mixed", "decodes"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(2, 2, 16), (6, 2, 32)])
def test_paged_attention_triton_matches_ref(dtype, layout, num_heads, num_kv_heads, head_size):
    batch = _to_device(
        make_paged_batch(layout, num_heads, num_kv_heads, head_size, BLOCK_SIZE, dtype)
    )
    scale = head_size**-0.5
    out = _run(attention.paged_attention, batch, scale)
    assert not out.isnan().any()
    assert_close(out, _run(attention_ref.paged_attention_ref, batch, scale), dtype)


@pytest.mark.usefixtures("triton_kernels")
def test_paged_attention_triton_odd_head_size_and_long_chunk():
    # head_size 40 pads to a 64-wide tile; a 70-token chunk spans several q blocks.
    batch = _to_device(make_paged_batch([(70, 90), (1, 33)], 3, 1, 40, BLOCK_SIZE, torch.float32))
    out = _run(attention.paged_attention, batch, 0.2)
    assert_close(out, _run(attention_ref.paged_attention_ref, batch, 0.2), torch.float32)


@pytest.mark.usefixtures("triton_kernels")
def test_paged_attention_triton_latent_layout():
    # DeepSeek's MLA (layers/mla_attention.py): 16 query heads over one shared head of 576
    # (latent 512 + rope key 64), the same cache passed as keys and values.
    batch = _to_device(make_paged_batch(MIXED[:3], 16, 1, 576, BLOCK_SIZE, torch.float32))
    batch = dataclasses.replace(batch, value_cache=batch.key_cache)
    out = _run(attention.paged_attention, batch, 0.1)
    assert_close(out, _run(attention_ref.paged_attention_ref, batch, 0.1), torch.float32)


@pytest.mark.parametrize("padding", [-1, 10**6])
@pytest.mark.parametrize("layout", [DECODES, UNIFORM_DECODES], ids=["decodes", "uniform"])
def test_paged_attention_ref_ignores_block_table_padding(padding, layout):
    # The batched decode gathers up to the longest request's block count, so shorter
    # requests' padding entries get read: any value there must be harmless. Rows past the
    # last request (a persistent max_num_reqs table) must be ignored.
    batch = make_paged_batch(layout, 4, 2, 16, BLOCK_SIZE, torch.float32)
    blocks_per_req = (batch.seq_lens + BLOCK_SIZE - 1) // BLOCK_SIZE
    padded = torch.arange(batch.block_table.shape[1]) >= blocks_per_req[:, None]
    batch.block_table[: len(layout)][padded] = padding
    batch.block_table[len(layout) :] = padding
    out = _run(attention_ref.paged_attention_ref, batch, 0.25)
    assert_close(out, dense_causal_attention(batch, 0.25), torch.float32)


def _cacheless_prefill_batch(
    query_lens: list[int], num_heads: int, num_kv_heads: int, head_size: int
) -> PagedBatch:
    # The worker's profile run has no cache yet: it passes this step's own K/V, strided views
    # of the fused qkv output, as a block_size-1 "cache" (token t = block t).
    num_tokens = sum(query_lens)
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size)
    query = qkv[:, :q_size].view(num_tokens, num_heads, head_size)
    keys = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_size)
    values = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_size)
    query_start_loc = torch.tensor([0] + query_lens).cumsum(0).int()
    offsets = torch.arange(max(query_lens), dtype=torch.int32)
    block_table = (query_start_loc[:-1, None] + offsets).clamp(max=num_tokens - 1)
    starts = query_start_loc.tolist()
    return PagedBatch(
        query,
        keys.unsqueeze(1),
        values.unsqueeze(1),
        block_table,
        query_start_loc,
        torch.tensor(query_lens, dtype=torch.int32),
        [keys[s:e] for s, e in zip(starts, starts[1:])],
        [values[s:e] for s, e in zip(starts, starts[1:])],
        query_lens,
    )


def test_paged_attention_ref_strided_block_size_one_cache():
    batch = _cacheless_prefill_batch([5, 1, 12], 6, 2, 16)
    out = _run(attention_ref.paged_attention_ref, batch, 0.25)
    assert_close(out, dense_causal_attention(batch, 0.25), torch.float32)


@pytest.mark.usefixtures("triton_kernels")
def test_paged_attention_triton_strided_block_size_one_cache():
    batch = _to_device(_cacheless_prefill_batch([5, 1, 12], 6, 2, 16))
    out = _run(attention.paged_attention, batch, 0.25)
    assert_close(out, _run(attention_ref.paged_attention_ref, batch, 0.25), torch.float32)


# Windows shorter than, equal to and inside a block; requests longer and shorter than them.
WINDOWED = [(17, 40), (1, 29), (7, 40), (1, 1), (3, 16), (1, 45), (1, 7)]
ATTENTION_OPTIONS = [(5, None), (16, None), (21, None), (None, 2.0), (9, 3.0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", [WINDOWED, DECODES], ids=["mixed", "decodes"])
@pytest.mark.parametrize("sliding_window,soft_cap", ATTENTION_OPTIONS)
def test_paged_attention_ref_window_and_soft_cap_match_dense(
    dtype, layout, sliding_window, soft_cap
):
    batch = make_paged_batch(layout, 6, 2, 16, BLOCK_SIZE, dtype)
    out = _run(attention_ref.paged_attention_ref, batch, 0.5, sliding_window, soft_cap)
    assert not out.isnan().any()
    expected = dense_causal_attention(batch, 0.5, sliding_window, soft_cap)
    assert_close(out, expected, dtype)
    # The options must change the result: the batch has keys outside every window.
    assert not torch.allclose(out.double(), dense_causal_attention(batch, 0.5), atol=1e-2)


@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.parametrize("sliding_window,soft_cap", ATTENTION_OPTIONS)
def test_paged_attention_triton_window_and_soft_cap_match_ref(sliding_window, soft_cap):
    batch = _to_device(make_paged_batch(WINDOWED, 6, 2, 32, BLOCK_SIZE, torch.float32))
    out = _run(attention.paged_attention, batch, 0.3, sliding_window, soft_cap)
    expected = _run(attention_ref.paged_attention_ref, batch, 0.3, sliding_window, soft_cap)
    assert_close(out, expected, torch.float32)


def _sinks(num_heads: int) -> torch.Tensor:
    # Logits on the scores' scale, so the sink takes a real share of each softmax.
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(7)) * 2.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "layout", [WINDOWED, DECODES, UNIFORM_DECODES], ids=["mixed", "decodes", "uniform"]
)
@pytest.mark.parametrize("sliding_window", [None, 9])
def test_paged_attention_ref_sinks_match_dense(dtype, layout, sliding_window):
    batch = make_paged_batch(layout, 6, 2, 16, BLOCK_SIZE, dtype)
    sinks = _sinks(6)
    out = _run(attention_ref.paged_attention_ref, batch, 0.5, sliding_window, None, sinks)
    assert_close(out, dense_causal_attention(batch, 0.5, sliding_window, None, sinks=sinks), dtype)
    without = dense_causal_attention(batch, 0.5, sliding_window)
    assert not torch.allclose(out.double(), without, atol=1e-2)


@pytest.mark.usefixtures("triton_kernels")
@pytest.mark.parametrize("sliding_window,soft_cap", [(None, None), (9, None), (None, 2.0)])
@pytest.mark.parametrize("layout", [WINDOWED, DECODES], ids=["mixed", "decodes"])
def test_paged_attention_triton_sinks_match_ref(sliding_window, soft_cap, layout):
    # Untested on a GPU so far: this runs Triton's interpreter where there is no CUDA.
    batch = _to_device(make_paged_batch(layout, 6, 2, 32, BLOCK_SIZE, torch.float32))
    sinks = _sinks(6).to(DEVICE)
    out = _run(attention.paged_attention, batch, 0.3, sliding_window, soft_cap, sinks)
    expected = _run(attention_ref.paged_attention_ref, batch, 0.3, sliding_window, soft_cap, sinks)
    assert_close(out, expected, torch.float32)


@pytest.mark.usefixtures("triton_kernels")
def test_paged_attention_triton_padded_decode_as_a_cuda_graph_runs_it():
    # services/worker/cuda_graphs.py: a decode batch padded to a captured size, with padding
    # rows of seq_len 1 over block 0, a block table of fixed width and a max_seq_len bound
    # for that width; the real rows come out as without the padding.
    batch = _to_device(make_paged_batch(DECODES, 9, 3, 64, BLOCK_SIZE, torch.float32))
    num_reqs, num_padding, width = len(DECODES), 3, 8
    size = num_reqs + num_padding
    block_table = torch.zeros(size, width, dtype=torch.int32, device=DEVICE)
    block_table[:num_reqs, : batch.block_table.shape[1]] = batch.block_table[:num_reqs]
    padding = torch.randn(num_padding, *batch.query.shape[1:], device=DEVICE)
    padded = dataclasses.replace(
        batch,
        query=torch.cat((batch.query, padding)),
        block_table=block_table,
        query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.cat(
            (batch.seq_lens, torch.ones(num_padding, dtype=torch.int32, device=DEVICE))
        ),
        query_lens=[1] * size,
    )
    out = attention.paged_attention(
        padded.query, padded.key_cache, padded.value_cache, padded.block_table,
        padded.query_start_loc, padded.seq_lens, 0.125, 1, width * BLOCK_SIZE,
    )  # fmt: skip
    torch.testing.assert_close(
        out[:num_reqs], _run(attention.paged_attention, batch, 0.125), rtol=0, atol=0
    )
