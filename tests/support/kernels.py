"""Builders, tolerances and naive oracles of the kernel tests.

DEVICE is where the Triton kernels run: compiled on a GPU, in Triton's interpreter on CPU
tensors otherwise (tests/kernels/conftest.py sets TRITON_INTERPRET before triton is imported).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# (atol, rtol) when comparing an op against its reference. bf16 allows ~2 ulps: the Triton
# interpreter rounds float32 -> bf16 by truncation, torch rounds to nearest.
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """actual has `dtype` and matches expected within that dtype's TOLERANCES."""
    atol, rtol = TOLERANCES[dtype]
    assert actual.dtype == dtype, (actual.dtype, dtype)
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@dataclass
class PagedBatch:
    """Inputs of one paged_attention call plus the dense K/V they were built from.

    Args:
        query: [T, Hq, D].
        key_cache, value_cache: [num_blocks, block_size, Hkv, D]; unused slots hold NaN.
        block_table: [R + 1, max_blocks] int32, padded with block 0.
        query_start_loc: [R + 1] int32; seq_lens: [R] int32.
        dense_keys, dense_values: per request, [seq_len, Hkv, D].
        query_lens: per request.
    """

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    dense_keys: list[torch.Tensor]
    dense_values: list[torch.Tensor]
    query_lens: list[int]

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max())


def make_paged_batch(
    query_and_seq_lens: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> PagedBatch:
    """Random requests laid into a shuffled paged cache.

    Args:
        query_and_seq_lens: (query_len, seq_len) per request; the queries are the last
            query_len tokens of the request's context.
    """
    generator = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-seq_len // block_size) for _, seq_len in query_and_seq_lens]
    # Spare blocks, never referenced, so physical ids are scattered and not contiguous.
    num_blocks = sum(blocks_per_req) + 3
    cache_shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    value_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    physical_ids = torch.randperm(num_blocks, generator=generator).tolist()
    # One spare row and column, as in the worker's persistent max_num_reqs-row table.
    block_table = torch.zeros(
        (len(query_and_seq_lens) + 1, max(blocks_per_req) + 1), dtype=torch.int32
    )
    dense_keys, dense_values = [], []
    for req, (_, seq_len) in enumerate(query_and_seq_lens):
        req_block_ids = [physical_ids.pop() for _ in range(blocks_per_req[req])]
        block_table[req, : len(req_block_ids)] = torch.tensor(req_block_ids)
        keys = torch.randn(seq_len, num_kv_heads, head_size, generator=generator).to(dtype)
        values = torch.randn(seq_len, num_kv_heads, head_size, generator=generator).to(dtype)
        for pos in range(seq_len):
            block_id, offset = req_block_ids[pos // block_size], pos % block_size
            key_cache[block_id, offset] = keys[pos]
            value_cache[block_id, offset] = values[pos]
        dense_keys.append(keys)
        dense_values.append(values)
    query_lens = [query_len for query_len, _ in query_and_seq_lens]
    query = torch.randn(sum(query_lens), num_heads, head_size, generator=generator).to(dtype)
    query_start_loc = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).int()
    seq_lens = torch.tensor([seq_len for _, seq_len in query_and_seq_lens], dtype=torch.int32)
    return PagedBatch(
        query,
        key_cache,
        value_cache,
        block_table,
        query_start_loc,
        seq_lens,
        dense_keys,
        dense_values,
        query_lens,
    )


def dense_causal_attention(
    batch: PagedBatch,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    chunk_size: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 attention from the dense per-request K/V, written from the definition.

    With sliding_window the query at position p sees keys p - sliding_window + 1 .. p; with
    soft_cap each score s becomes soft_cap * tanh(s / soft_cap); with chunk_size only the keys
    t of its own chunk, t // chunk_size == p // chunk_size; with sinks [Hq], head h's softmax
    has one more logit, sinks[h], whose weight multiplies no value."""
    num_heads = batch.query.shape[1]
    out = torch.empty(batch.query.shape, dtype=torch.float64)
    start = 0
    for query_len, keys, values in zip(batch.query_lens, batch.dense_keys, batch.dense_values):
        seq_len, num_kv_heads = keys.shape[:2]
        group = num_heads // num_kv_heads
        for i in range(query_len):
            position = seq_len - query_len + i
            for head in range(num_heads):
                first = max(position + 1 - sliding_window, 0) if sliding_window else 0
                if chunk_size:
                    first = max(first, position // chunk_size * chunk_size)
                q = batch.query[start + i, head].double()
                k = keys[first : position + 1, head // group].double()
                v = values[first : position + 1, head // group].double()
                scores = (k @ q) * scale
                if soft_cap:
                    scores = soft_cap * torch.tanh(scores / soft_cap)
                if sinks is not None:
                    scores = torch.cat((scores, sinks[head : head + 1].double()))
                weights = torch.softmax(scores, dim=0)[: v.shape[0]]
                out[start + i, head] = weights @ v
        start += query_len
    return out
