"""Paged attention over flattened varlen queries (prefill chunks and decodes in one call).

The queries of R requests lie end to end; request r owns rows
query_start_loc[r] .. query_start_loc[r + 1] and has seq_lens[r] tokens of context in the cache
(its new tokens included). Its query j sits at position seq_lens[r] - query_len[r] + j:

    context:  | 0 ............................................ seq_len - 1 |
    queries:                                 | seq_len - query_len .. seq_len - 1 |

and attends to keys 0..its own position, read through block_table[r] (block_size tokens per
block). Query head h reads KV head h // (Hq // Hkv) (GQA).

Three options, off by default (the fast paths): a sliding window W limits query position p to
keys p - W < t <= p (Mistral, Gemma); a logits soft cap c squashes every score s = scale q.k to
c * tanh(s / c) before the softmax (Gemma 2); attention sinks (gpt-oss) add one learned logit
per query head to the softmax's denominator, a key no value goes with:
out = sum_t exp(s_t) v_t / (exp(sink_h) + sum_t exp(s_t)). The cache keeps every block: keys
older than the window are masked, not freed.

A third, chunked local attention (Llama 4's `attention_chunk_size` C), splits positions into
chunks [0, C), [C, 2C), ... and lets query position p see only the keys of its own chunk:
p // C * C <= t <= p. It is a window whose start depends on the query, and every path
computes it as one: the first key a query reads is the later of the window's start and its
chunk's start.

The Triton path may be captured in a CUDA graph (services/worker/cuda_graphs.py): it reads
the request bounds on the device and takes from the host only shapes and max_query_len (which
picks the tile), so a decode step of fixed size launches the same grid every time. The torch
paths (CPU) read the bounds on the host (`.tolist()`, `nonzero`) and are never captured.

Here: the Triton kernel and its wrapper `paged_attention`. The torch reference is
attention_ref.py, the CPU fast path attention_cpu.py (its two prefill routes cpu_prefill.py,
the choice between them prefill_route.py); kernels.dispatch picks one.
"""

from __future__ import annotations

import torch

from kvserve.kernels._triton import HAS_TRITON, next_power_of_2, require_triton, tl, triton
from kvserve.kernels.cache import is_fp8

# Keys per inner-loop step of the Triton kernel.
_TILE_N = 32

if HAS_TRITON:

    @triton.jit
    def _tanh(x):
        # 1 - 2 / (e^2x + 1): saturates to -1 and 1 without inf / inf.
        return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)

    @triton.jit
    def _find_request(query_start_loc_ptr, num_reqs, q_block_idx, BLOCK_Q: tl.constexpr):
        # Request r owns q blocks from query_start_loc[r] // BLOCK_Q + r on: that start grows
        # with r and leaves each request at least cdiv(query_len, BLOCK_Q) blocks. Binary
        # search for the last request whose first block is <= q_block_idx.
        low = 0
        high = num_reqs
        while low < high:
            mid = (low + high) // 2
            mid_start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
            if mid_start <= q_block_idx:
                low = mid + 1
            else:
                high = mid
        return low - 1

    @triton.jit
    def _softmax_start(sinks_ptr, heads, row_mask, BLOCK_M: tl.constexpr, USE_SINKS: tl.constexpr):
        """(row max, row sum) before the first key: empty, or the sink's logit alone."""
        row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        if USE_SINKS:
            # The sink is a key seen first whose value is zero: exp2(sink - max) in the sum.
            sink = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0).to(tl.float32)
            row_max = sink * 1.4426950408889634
            row_sum = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        return row_max, row_sum

    @triton.jit
    def _key_range(
        context_len, query_len, q_block_in_req, sliding_window, chunk_size,
        BLOCK_Q: tl.constexpr, USE_WINDOW: tl.constexpr, USE_CHUNK: tl.constexpr,
    ):  # fmt: skip
        """[first_key, num_keys): the keys some row of this q block may see."""
        # Keys past this block's last query are invisible to all its rows.
        num_keys = context_len + tl.minimum(query_len, (q_block_in_req + 1) * BLOCK_Q)
        first_key = 0
        if USE_WINDOW:
            # Keys before the window of this block's first query are invisible to all its rows.
            first_key = tl.maximum(context_len + q_block_in_req * BLOCK_Q - sliding_window + 1, 0)
        if USE_CHUNK:
            # Keys before the chunk of this block's first query are invisible to all its rows.
            block_first_position = context_len + q_block_in_req * BLOCK_Q
            first_key = tl.maximum(first_key, block_first_position // chunk_size * chunk_size)
        return first_key, num_keys

    @triton.jit
    def _slot_offsets(
        table_row_ptr, keys, key_mask, kv_head,
        cache_block_stride, cache_slot_stride, cache_head_stride, BLOCK_SIZE: tl.constexpr,
    ):  # fmt: skip
        """The cache offsets of this KV head's slots of `keys`, read through the block table."""
        block_ids = tl.load(table_row_ptr + keys // BLOCK_SIZE, mask=key_mask, other=0)
        return (
            block_ids.to(tl.int64) * cache_block_stride
            + (keys % BLOCK_SIZE) * cache_slot_stride
            + kv_head * cache_head_stride
        )

    @triton.jit
    def _scores(
        q, k, scale, soft_cap, keys, key_mask, query_positions, sliding_window, chunk_size,
        DOT_PRECISION: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
        USE_CHUNK: tl.constexpr,
    ):  # fmt: skip
        """Scores of the rows' queries against a key tile (k: [D, TILE_N]), in the exp2
        domain, -inf where the causal mask, the window or the chunk hides the key."""
        if USE_SOFT_CAP:
            scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale
            scores = soft_cap * _tanh(scores / soft_cap) * 1.4426950408889634
        else:
            qk_scale = scale * 1.4426950408889634  # log2(e): softmax via exp2
            scores = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        visible = (keys[None, :] <= query_positions[:, None]) & key_mask[None, :]
        if USE_WINDOW:
            visible = visible & (keys[None, :] > query_positions[:, None] - sliding_window)
        if USE_CHUNK:
            chunk_starts = query_positions // chunk_size * chunk_size
            visible = visible & (keys[None, :] >= chunk_starts[:, None])
        return tl.where(visible, scores, float("-inf"))

    @triton.jit
    def _online_softmax_update(acc, row_max, row_sum, scores, v, DOT_PRECISION: tl.constexpr):
        """Fold one tile of scores and its values into the running (acc, max, sum)."""
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # Rows with nothing visible yet (padding rows) keep a finite shift: no inf - inf.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(scores - shift[:, None])
        rescale = tl.exp2(row_max - shift)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
        return acc, new_max, row_sum

    @triton.jit
    def _attend_tile(
        acc, row_max, row_sum, q, keys, num_keys,
        query_positions, dims, dim_mask, table_row_ptr, key_cache_ptr, value_cache_ptr,
        kv_head, cache_block_stride, cache_slot_stride, cache_head_stride,
        scale, soft_cap, sliding_window, chunk_size, k_scale, v_scale,
        BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_WINDOW: tl.constexpr,
        USE_SOFT_CAP: tl.constexpr, USE_CHUNK: tl.constexpr, KV_FP8: tl.constexpr,
    ):  # fmt: skip
        """Read one tile of keys (those >= num_keys masked) and their values through the block
        table and fold them into the rows' running (acc, max, sum)."""
        key_mask = keys < num_keys
        slot_offsets = _slot_offsets(
            table_row_ptr, keys, key_mask, kv_head,
            cache_block_stride, cache_slot_stride, cache_head_stride, BLOCK_SIZE,
        )  # fmt: skip
        k = tl.load(
            key_cache_ptr + slot_offsets[None, :] + dims[:, None],
            mask=key_mask[None, :] & dim_mask[:, None],
            other=0.0,
        )
        if KV_FP8:  # 8-bit keys times their scale, in registers
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
        scores = _scores(
            q, k, scale, soft_cap, keys, key_mask, query_positions, sliding_window,
            chunk_size, DOT_PRECISION, USE_WINDOW, USE_SOFT_CAP, USE_CHUNK,
        )  # fmt: skip
        v = tl.load(
            value_cache_ptr + slot_offsets[:, None] + dims[None, :],
            mask=key_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )
        if KV_FP8:
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        return _online_softmax_update(acc, row_max, row_sum, scores, v, DOT_PRECISION)

    @triton.jit
    def _paged_attention_kernel(
        out_ptr, query_ptr, key_cache_ptr, value_cache_ptr,
        block_table_ptr, query_start_loc_ptr, seq_lens_ptr,
        scale, sliding_window, soft_cap, chunk_size, sinks_ptr, k_scale, v_scale, num_reqs,
        query_token_stride, query_head_stride, out_token_stride, out_head_stride,
        cache_block_stride, cache_slot_stride, cache_head_stride, block_table_stride,
        NUM_QUERIES_PER_KV: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_HEAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
        TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
        USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, USE_CHUNK: tl.constexpr,
        USE_SINKS: tl.constexpr, KV_FP8: tl.constexpr,
    ):  # fmt: skip
        """Grid: (q block, KV head). A program's BLOCK_M rows are (query token, query head of
        this KV head) pairs, row m = token m // G, head m % G, so every K/V tile it loads
        serves the whole GQA group. Online softmax in float32, exp2 domain."""
        q_block_idx = tl.program_id(0)
        kv_head = tl.program_id(1)
        req = _find_request(query_start_loc_ptr, num_reqs, q_block_idx, BLOCK_Q)
        query_start = tl.load(query_start_loc_ptr + req)
        query_len = tl.load(query_start_loc_ptr + req + 1) - query_start
        q_block_in_req = q_block_idx - (query_start // BLOCK_Q + req)
        if q_block_in_req * BLOCK_Q >= query_len:
            return  # a spare block: the grid has an upper bound of q blocks
        seq_len = tl.load(seq_lens_ptr + req)
        context_len = seq_len - query_len

        rows = tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_HEAD)
        query_idx = q_block_in_req * BLOCK_Q + rows // NUM_QUERIES_PER_KV
        heads = kv_head * NUM_QUERIES_PER_KV + rows % NUM_QUERIES_PER_KV
        row_mask = (rows < BLOCK_Q * NUM_QUERIES_PER_KV) & (query_idx < query_len)
        dim_mask = dims < HEAD_SIZE
        tokens = (query_start + query_idx).to(tl.int64)
        tile_mask = row_mask[:, None] & dim_mask[None, :]
        query_offsets = tokens[:, None] * query_token_stride + heads[:, None] * query_head_stride
        q = tl.load(query_ptr + query_offsets + dims[None, :], mask=tile_mask, other=0.0)
        query_positions = context_len + query_idx

        row_max, row_sum = _softmax_start(sinks_ptr, heads, row_mask, BLOCK_M, USE_SINKS)
        acc = tl.zeros([BLOCK_M, BLOCK_HEAD], dtype=tl.float32)
        first_key, num_keys = _key_range(
            context_len, query_len, q_block_in_req, sliding_window, chunk_size,
            BLOCK_Q, USE_WINDOW, USE_CHUNK,
        )  # fmt: skip
        table_row_ptr = block_table_ptr + req * block_table_stride
        for tile_start in range(first_key, num_keys, TILE_N):
            acc, row_max, row_sum = _attend_tile(
                acc, row_max, row_sum, q, tile_start + tl.arange(0, TILE_N), num_keys,
                query_positions, dims, dim_mask, table_row_ptr, key_cache_ptr, value_cache_ptr,
                kv_head, cache_block_stride, cache_slot_stride, cache_head_stride,
                scale, soft_cap, sliding_window, chunk_size, k_scale, v_scale,
                BLOCK_SIZE, DOT_PRECISION, USE_WINDOW, USE_SOFT_CAP, USE_CHUNK, KV_FP8,
            )  # fmt: skip
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        out_offsets = tokens[:, None] * out_token_stride + heads[:, None] * out_head_stride
        tl.store(
            out_ptr + out_offsets + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=tile_mask,
        )


def check_attention_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
) -> None:
    """Assert the shapes of the paged attention contract (every path checks the same)."""
    assert query.dim() == 3, f"query must be [T, Hq, D], got {query.shape}"
    assert key_cache.dim() == 4 and key_cache.shape == value_cache.shape, key_cache.shape
    num_heads, head_size = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1:3]
    assert key_cache.shape[3] == head_size, (key_cache.shape, head_size)
    assert num_heads % num_kv_heads == 0, f"Hq={num_heads} not a multiple of Hkv={num_kv_heads}"
    num_reqs = seq_lens.shape[0]
    assert query_start_loc.shape == (num_reqs + 1,), (query_start_loc.shape, num_reqs)
    assert block_table.dim() == 2 and block_table.shape[0] >= num_reqs, block_table.shape
    assert block_table.shape[1] * block_size >= max_seq_len, (
        f"block_table width {block_table.shape[1]} x {block_size} < max_seq_len {max_seq_len}"
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    attention_chunk_size: int | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Triton paged attention; contract in kernels.dispatch.paged_attention.

    Args:
        query: [T, Hq, D], last dim contiguous.
        key_cache, value_cache: [num_blocks, block_size, Hkv, D], last dim contiguous.
        block_table: [R, max_blocks] int32, rows contiguous.
        query_start_loc: [R + 1] int32; seq_lens: [R] int32.
        scale: softmax scale; max_query_len, max_seq_len: host-side maxima.
        sliding_window, logits_soft_cap, attention_chunk_size, sinks: the options of the
            module docstring (None: off); sinks [Hq], contiguous.
    Returns:
        [T, Hq, D] contiguous, query's dtype.
    """
    require_triton("paged_attention")
    check_attention_args(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, max_seq_len
    )
    assert query.stride(2) == 1 and key_cache.stride(3) == 1 and block_table.stride(1) == 1
    assert key_cache.stride() == value_cache.stride(), "K and V caches must share a layout"
    assert query_start_loc.is_contiguous() and seq_lens.is_contiguous()
    num_tokens = query.shape[0]
    num_kv_heads = key_cache.shape[2]
    num_reqs = seq_lens.shape[0]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    constexprs = _kernel_constexprs(
        query,
        key_cache,
        max_query_len,
        sliding_window,
        logits_soft_cap,
        attention_chunk_size,
        sinks,
    )
    # Request r may start a partial q block, hence + num_reqs spare blocks (they exit at once).
    grid = (triton.cdiv(num_tokens, constexprs["BLOCK_Q"]) + num_reqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out, query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
        scale, sliding_window or 0, logits_soft_cap or 0.0, attention_chunk_size or 1,
        sinks if sinks is not None else out,  # unread without USE_SINKS
        k_scale, v_scale, num_reqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0),
        **constexprs,
    )  # fmt: skip
    return out


def _kernel_constexprs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    max_query_len: int,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    attention_chunk_size: int | None,
    sinks: torch.Tensor | None,
) -> dict[str, object]:
    """The kernel's compile-time arguments: the head layout, the tile shape of this step, the
    options switched on."""
    num_heads, head_size = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1:3]
    num_queries_per_kv = num_heads // num_kv_heads
    # Decode-only steps get small tiles (one token x G heads); prefills fill bigger ones.
    block_m = max(16 if max_query_len == 1 else 64, next_power_of_2(num_queries_per_kv))
    return dict(
        NUM_QUERIES_PER_KV=num_queries_per_kv,
        HEAD_SIZE=head_size,
        BLOCK_HEAD=max(next_power_of_2(head_size), 16),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_m // num_queries_per_kv,
        TILE_N=_TILE_N,
        # fp32 runs are the exactness reference: keep tf32 out of them.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        USE_WINDOW=bool(sliding_window),
        USE_SOFT_CAP=bool(logits_soft_cap),
        USE_CHUNK=bool(attention_chunk_size),
        USE_SINKS=sinks is not None,
        KV_FP8=is_fp8(key_cache.dtype),
    )
