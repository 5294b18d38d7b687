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
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from kvserve.kernels import cpu
from kvserve.kernels._triton import HAS_TRITON, next_power_of_2, require_triton, tl, triton
from kvserve.kernels.cache import dequantize_kv, is_fp8

# Keys per inner-loop step of the Triton kernel.
_TILE_N = 32
# Bytes of padded K + V one decode group of the torch reference may gather. Bounded so the
# temporaries come from the allocator's heap instead of fresh page-faulted mmaps (4x slower
# on a 50 MB gather) and stay nearer the CPU caches: ~10k tokens of SmolLM2 K/V in fp32.
_DECODE_GROUP_BYTES = 16 << 20

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
    def _paged_attention_kernel(
        out_ptr,
        query_ptr,
        key_cache_ptr,
        value_cache_ptr,
        block_table_ptr,
        query_start_loc_ptr,
        seq_lens_ptr,
        scale,
        sliding_window,
        soft_cap,
        chunk_size,
        sinks_ptr,
        k_scale,
        v_scale,
        num_reqs,
        query_token_stride,
        query_head_stride,
        out_token_stride,
        out_head_stride,
        cache_block_stride,
        cache_slot_stride,
        cache_head_stride,
        block_table_stride,
        NUM_QUERIES_PER_KV: tl.constexpr,
        HEAD_SIZE: tl.constexpr,
        BLOCK_HEAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        TILE_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        USE_WINDOW: tl.constexpr,
        USE_SOFT_CAP: tl.constexpr,
        USE_CHUNK: tl.constexpr,
        USE_SINKS: tl.constexpr,
        KV_FP8: tl.constexpr,
    ):
        # Grid: (q block, KV head). A program's BLOCK_M rows are (query token, query head of
        # this KV head) pairs, row m = token m // G, head m % G, so every K/V tile it loads
        # serves the whole GQA group. Online softmax in float32, exp2 domain.
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
        q = tl.load(
            query_ptr
            + tokens[:, None] * query_token_stride
            + heads[:, None] * query_head_stride
            + dims[None, :],
            mask=row_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )
        query_positions = context_len + query_idx

        row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        if USE_SINKS:
            # The sink is a key seen first whose value is zero: exp2(sink - max) in the sum.
            sink = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0).to(tl.float32)
            row_max = sink * 1.4426950408889634
            row_sum = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_HEAD], dtype=tl.float32)
        qk_scale = scale * 1.4426950408889634  # log2(e): softmax via exp2
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
        for tile_start in range(first_key, num_keys, TILE_N):
            keys = tile_start + tl.arange(0, TILE_N)
            key_mask = keys < num_keys
            block_ids = tl.load(
                block_table_ptr + req * block_table_stride + keys // BLOCK_SIZE,
                mask=key_mask,
                other=0,
            )
            slot_offsets = (
                block_ids.to(tl.int64) * cache_block_stride
                + (keys % BLOCK_SIZE) * cache_slot_stride
                + kv_head * cache_head_stride
            )
            k = tl.load(
                key_cache_ptr + slot_offsets[None, :] + dims[:, None],
                mask=key_mask[None, :] & dim_mask[:, None],
                other=0.0,
            )
            if KV_FP8:  # 8-bit keys times their scale, in registers
                k = (k.to(tl.float32) * k_scale).to(q.dtype)
            if USE_SOFT_CAP:
                scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale
                scores = soft_cap * _tanh(scores / soft_cap) * 1.4426950408889634
            else:
                scores = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
            visible = (keys[None, :] <= query_positions[:, None]) & key_mask[None, :]
            if USE_WINDOW:
                visible = visible & (keys[None, :] > query_positions[:, None] - sliding_window)
            if USE_CHUNK:
                chunk_starts = query_positions // chunk_size * chunk_size
                visible = visible & (keys[None, :] >= chunk_starts[:, None])
            scores = tl.where(visible, scores, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(scores, axis=1))
            # Rows with nothing visible yet (padding rows) keep a finite shift: no inf - inf.
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            probs = tl.exp2(scores - shift[:, None])
            rescale = tl.exp2(row_max - shift)
            row_sum = row_sum * rescale + tl.sum(probs, axis=1)
            v = tl.load(
                value_cache_ptr + slot_offsets[:, None] + dims[None, :],
                mask=key_mask[:, None] & dim_mask[None, :],
                other=0.0,
            )
            if KV_FP8:
                v = (v.to(tl.float32) * v_scale).to(q.dtype)
            acc = acc * rescale[:, None] + tl.dot(
                probs.to(v.dtype), v, input_precision=DOT_PRECISION
            )
            row_max = new_max
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        tl.store(
            out_ptr
            + tokens[:, None] * out_token_stride
            + heads[:, None] * out_head_stride
            + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & dim_mask[None, :],
        )


def _check_attention_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
) -> None:
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
    _check_attention_args(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, max_seq_len
    )
    assert query.stride(2) == 1 and key_cache.stride(3) == 1 and block_table.stride(1) == 1
    assert key_cache.stride() == value_cache.stride(), "K and V caches must share a layout"
    assert query_start_loc.is_contiguous() and seq_lens.is_contiguous()
    num_tokens, num_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1:3]
    num_reqs = seq_lens.shape[0]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    num_queries_per_kv = num_heads // num_kv_heads
    # Decode-only steps get small tiles (one token x G heads); prefills fill bigger ones.
    block_m = max(16 if max_query_len == 1 else 64, next_power_of_2(num_queries_per_kv))
    block_q = block_m // num_queries_per_kv
    # Request r may start a partial q block, hence + num_reqs spare blocks (they exit at once).
    grid = (triton.cdiv(num_tokens, block_q) + num_reqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        block_table,
        query_start_loc,
        seq_lens,
        scale,
        sliding_window or 0,
        logits_soft_cap or 0.0,
        attention_chunk_size or 1,
        sinks if sinks is not None else out,  # unread without USE_SINKS
        k_scale,
        v_scale,
        num_reqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_table.stride(0),
        NUM_QUERIES_PER_KV=num_queries_per_kv,
        HEAD_SIZE=head_size,
        BLOCK_HEAD=max(next_power_of_2(head_size), 16),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=_TILE_N,
        # fp32 runs are the exactness reference: keep tf32 out of them.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        USE_WINDOW=bool(sliding_window),
        USE_SOFT_CAP=bool(logits_soft_cap),
        USE_CHUNK=bool(attention_chunk_size),
        USE_SINKS=sinks is not None,
        KV_FP8=is_fp8(key_cache.dtype),
    )
    return out


def _group_decodes(
    decode_reqs: list[int], req_seq_lens: list[int], block_size: int, max_group_tokens: int
) -> list[list[int]]:
    """Split decode requests into groups of similar length, longest first.

    A request joins the current group while its block count is >= 3/4 of the group's longest
    (padding wastes at most 1/3) and the padded group stays within max_group_tokens.
    """
    groups: list[list[int]] = []
    group_blocks = 0
    for req in sorted(decode_reqs, key=lambda req: req_seq_lens[req], reverse=True):
        num_blocks = -(-req_seq_lens[req] // block_size)
        if (
            groups
            and 4 * num_blocks >= 3 * group_blocks
            and (len(groups[-1]) + 1) * group_blocks * block_size <= max_group_tokens
        ):
            groups[-1].append(req)
        else:
            groups.append([req])
            group_blocks = num_blocks
    return groups


def _attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    soft_cap: float | None,
    enable_gqa: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    # SDPA (causal when mask is None), or with a soft cap or sinks, which SDPA lacks, the same
    # in plain float32 ops. sinks: broadcastable to the scores' [..., rows, 1].
    if not soft_cap and sinks is None:
        return F.scaled_dot_product_attention(
            query,
            keys,
            values,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    if enable_gqa:
        group = query.shape[-3] // keys.shape[-3]
        keys, values = (t.repeat_interleave(group, dim=-3) for t in (keys, values))
    scores = (query.float() @ keys.float().transpose(-1, -2)) * scale
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=query.device).tril_()
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return (scores.softmax(dim=-1) @ values.float()).to(query.dtype)
    # The sink joins the softmax as one more column, then is dropped: it has no value.
    sink_column = sinks.float().expand(*scores.shape[:-1], 1)
    probs = torch.cat((scores, sink_column), dim=-1).softmax(dim=-1)[..., :-1]
    return (probs @ values.float()).to(query.dtype)


def _decode_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_blocks: int,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    chunk_size: int | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    # query: [R, Hq, D], one token per request, the last of its context. Gather the first
    # num_blocks blocks of every request into a padded [R, Hkv, S_pad, D] view and run one
    # masked SDPA.
    num_reqs, num_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1:3]
    padded_len = num_blocks * block_size
    # Table entries past a request's own blocks get read too (their slots are zeroed and
    # masked below); clamping keeps whatever padding the table holds a valid block id.
    block_ids = block_table[:, :num_blocks].reshape(-1).clamp(0, key_cache.shape[0] - 1)
    key_positions = torch.arange(padded_len, device=query.device)
    visible = key_positions < seq_lens.unsqueeze(1)  # [R, S_pad]
    if sliding_window:
        visible &= key_positions >= (seq_lens - sliding_window).unsqueeze(1)
    if chunk_size:  # the query (position seq_len - 1) sees its own chunk only
        visible &= key_positions >= ((seq_lens - 1) // chunk_size * chunk_size).unsqueeze(1)
    # Slots past a request's end hold stale or never-written data (NaN in an uninitialized
    # cache), and a masked NaN still poisons SDPA (0 * NaN): zero those rows after the gather.
    hidden_slots = (~visible).view(-1).nonzero().squeeze(1)
    keys, values = (
        dequantize_kv(cache.index_select(0, block_ids), kv_scale, query.dtype)
        .view(num_reqs * padded_len, num_kv_heads, head_size)
        .index_fill_(0, hidden_slots, 0.0)
        .view(num_reqs, padded_len, num_kv_heads, head_size)
        .transpose(1, 2)
        for cache, kv_scale in ((key_cache, k_scale), (value_cache, v_scale))
    )
    # A decode token's G query heads share their KV head's keys and mask: fold them into
    # SDPA's query-length dim, so GQA needs no expanded K/V copy.
    group = num_heads // num_kv_heads
    queries = query.reshape(num_reqs, num_kv_heads, group, head_size)
    head_sinks = sinks.view(num_kv_heads, group, 1) if sinks is not None else None
    out = _attention(
        queries, keys, values, visible[:, None, None, :], scale, soft_cap, sinks=head_sinks
    )
    return out.reshape(num_reqs, num_heads, head_size)


def _prefill_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_ids: torch.Tensor,
    seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    chunk_size: int | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    # query: [L, Hq, D], the last L tokens of a seq_len context; block_ids: its table row.
    query_len, num_heads = query.shape[:2]
    block_size, num_kv_heads = key_cache.shape[1:3]
    context_len = seq_len - query_len
    # With a window, keys before the first query's window are read by no query.
    first_key = max(context_len - sliding_window + 1, 0) if sliding_window else 0
    if chunk_size:  # and keys before the first query's chunk
        first_key = max(first_key, context_len // chunk_size * chunk_size)
    first_block = first_key // block_size
    used_block_ids = block_ids[first_block : -(-seq_len // block_size)]
    num_keys = seq_len - first_block * block_size
    keys, values = (
        dequantize_kv(cache.index_select(0, used_block_ids), kv_scale, query.dtype)
        .flatten(0, 1)[:num_keys]
        .transpose(0, 1)
        for cache, kv_scale in ((key_cache, k_scale), (value_cache, v_scale))
    )
    mask = None
    if query_len < num_keys or sliding_window or chunk_size:
        # A chunk starting mid-sequence: SDPA's is_causal aligns top-left, we need bottom-right.
        positions = torch.arange(context_len, seq_len, device=query.device).unsqueeze(1)
        key_positions = torch.arange(first_block * block_size, seq_len, device=query.device)
        mask = key_positions <= positions
        if sliding_window:
            mask &= key_positions > positions - sliding_window
        if chunk_size:
            mask &= key_positions >= positions // chunk_size * chunk_size
    out = _attention(
        query.transpose(0, 1),
        keys,
        values,
        mask,
        scale,
        soft_cap,
        enable_gqa=num_heads != num_kv_heads,
        sinks=sinks.view(num_heads, 1, 1) if sinks is not None else None,
    )
    return out.transpose(0, 1)


def paged_attention_ref(
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
    """Torch paged attention (the CPU hot path); same contract as `paged_attention`.

    Decodes (query_len 1) run batched: grouped by similar length, one masked SDPA per group
    over K/V gathered into a padded batch. Every other request (a prefill or a chunk of one)
    runs one SDPA of its own. Per call: one host read of the request bounds, no Python work
    per token.
    """
    _check_attention_args(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, max_seq_len
    )
    num_reqs = seq_lens.shape[0]
    block_size, num_kv_heads, head_size = key_cache.shape[1:]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    bounds = torch.cat((query_start_loc, seq_lens)).tolist()  # the one host read
    query_starts, req_seq_lens = bounds[: num_reqs + 1], bounds[num_reqs + 1 :]
    decode_reqs: list[int] = []
    for req, seq_len in enumerate(req_seq_lens):
        start, end = query_starts[req], query_starts[req + 1]
        if end - start == 1:
            decode_reqs.append(req)
        elif end > start:
            out[start:end] = _prefill_attention_ref(
                query[start:end],
                key_cache,
                value_cache,
                block_table[req],
                seq_len,
                scale,
                sliding_window,
                logits_soft_cap,
                attention_chunk_size,
                sinks,
                k_scale,
                v_scale,
            )
    max_group_tokens = _DECODE_GROUP_BYTES // (
        2 * num_kv_heads * head_size * key_cache.element_size()
    )
    for group in _group_decodes(decode_reqs, req_seq_lens, block_size, max_group_tokens):
        num_blocks = -(-req_seq_lens[group[0]] // block_size)  # longest first
        if len(group) == num_reqs == query.shape[0] and group == list(range(num_reqs)):
            # All decodes, in order, one group (the common decode step): no index shuffles.
            return _decode_attention_ref(
                query,
                key_cache,
                value_cache,
                block_table[:num_reqs],
                seq_lens,
                scale,
                num_blocks,
                sliding_window,
                logits_soft_cap,
                attention_chunk_size,
                sinks,
                k_scale,
                v_scale,
            )
        req_indices = torch.tensor(group, device=query.device)
        token_indices = torch.tensor([query_starts[req] for req in group], device=query.device)
        group_out = _decode_attention_ref(
            query.index_select(0, token_indices),
            key_cache,
            value_cache,
            block_table.index_select(0, req_indices),
            seq_lens.index_select(0, req_indices),
            scale,
            num_blocks,
            sliding_window,
            logits_soft_cap,
            attention_chunk_size,
            sinks,
            k_scale,
            v_scale,
        )
        out.index_copy_(0, token_indices, group_out)
    return out


def _flash(query, keys, values, causal: bool, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, keys, values, 0.0, causal, scale=scale
    )


def _prefill_attention_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_ids: torch.Tensor,
    seq_len: int,
    scale: float,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    # A chunk that starts mid-sequence needs a bottom-right causal mask, which sends SDPA to
    # its slow math path (a materialized [H, L, S] mask and scores). Instead, two flash calls:
    # the queries over the context before the chunk (no mask) and over the chunk itself
    # (plain causal: square), merged by their log-sum-exps.
    #
    #   keys:    | 0 ....... context_len - 1 | context_len ... seq_len - 1 |
    #              flash(mask = none)          flash(is_causal)
    query_len = query.shape[0]
    context_len = seq_len - query_len
    block_size = key_cache.shape[1]
    used_block_ids = block_ids[: -(-seq_len // block_size)]
    keys, values = (
        dequantize_kv(cache.index_select(0, used_block_ids), kv_scale, query.dtype)
        .flatten(0, 1)[:seq_len]
        .transpose(0, 1)
        .unsqueeze(0)
        for cache, kv_scale in ((key_cache, k_scale), (value_cache, v_scale))
    )
    q = query.transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
    out, lse = _flash(q, keys[:, :, context_len:], values[:, :, context_len:], True, scale)
    if context_len:
        out_ctx, lse_ctx = _flash(
            q, keys[:, :, :context_len], values[:, :, :context_len], False, scale
        )
        lse_max = torch.maximum(lse, lse_ctx)
        w, w_ctx = (lse - lse_max).exp_().unsqueeze(-1), (lse_ctx - lse_max).exp_().unsqueeze(-1)
        out = ((out.float() * w + out_ctx.float() * w_ctx) / (w + w_ctx)).to(query.dtype)
        lse = lse_max + (w + w_ctx).squeeze(-1).log()
    if sinks is not None:
        # The sink's term in the denominator: out * S / (S + e^sink) = out * sigmoid(lse - sink)
        # with S = e^lse the keys' sum.
        keep = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1)).unsqueeze(-1)
        out = (out.float() * keep).to(query.dtype)
    return out[0].transpose(0, 1)


# What ran the flash route last, per (dtype, Hq, Hkv, D): "AMX tiles" or "torch's flash" (the
# start-up log names it after measure_prefill_route).
FLASH_ROUTE: dict[tuple[torch.dtype, int, int, int], str] = {}


def _prefill_chunks(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    reqs: list[int],
    starts: list[int],
    lens: list[int],
    scale: float,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """out's rows of the prefill chunks of requests `reqs` (starts: query_start_loc, lens:
    seq_lens, as lists): all in one call on AMX tiles where the CPU has them (bfloat16,
    cpu.prefill_attention_amx; not with sinks: the kernel returns no log-sum-exps), else
    chunk by chunk through torch's flash attention (sinks applied from its log-sum-exps; an
    fp8 cache's blocks gathered and multiplied back: the AMX kernel reads float caches only)."""
    layout = (query.dtype, query.shape[1], key_cache.shape[2], query.shape[2])
    if sinks is None and cpu.prefill_attention_amx(
        out, query, key_cache, value_cache, block_table, query_start_loc, seq_lens, reqs, scale
    ):
        FLASH_ROUTE[layout] = "AMX tiles"
        return
    FLASH_ROUTE[layout] = "torch's flash"
    for req in reqs:
        start, end = starts[req], starts[req + 1]
        out[start:end] = _prefill_attention_cpu(
            query[start:end],
            key_cache,
            value_cache,
            block_table[req],
            lens[req],
            scale,
            sinks,
            k_scale,
            v_scale,
        )


# The longest prefill chunk (in query tokens) the decode kernel takes, per (dtype, Hq, Hkv, D):
# measured at start-up by measure_prefill_route; absent, the defaults below.
_DECODE_KERNEL_MAX_QUERY_LEN: dict[tuple[torch.dtype, int, int, int], int] = {}
# First-chunk lengths measure_prefill_route times on both routes. Shorter chunks (a
# speculative verify step's 1 + k, a prompt's tail) always take the decode kernel.
PREFILL_PROBE_LENS = (32, 64, 128, 256, 512, 1024)
# Over this many keys a bfloat16 chunk takes flash whatever its length (measured on a Zen 5:
# 0.95-1.2x beyond it, bench/RESULTS.md).
_BF16_DECODE_KERNEL_MAX_KEYS = 1024


def decode_kernel_max_query_len(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_size: int
) -> int:
    """The longest prefill chunk the decode kernel takes for this dtype and head layout: the
    start-up measurement's where there is one (measure_prefill_route), else the defaults
    measured in bench/RESULTS.md: bfloat16 63 with AMX (the flash route runs on its tiles
    there) and 1024 without; float32 512 (a Zen 5's crossover)."""
    measured = _DECODE_KERNEL_MAX_QUERY_LEN.get((dtype, num_heads, num_kv_heads, head_size))
    if measured is not None:
        return measured
    if dtype == torch.bfloat16:
        return 63 if cpu.cpu_has_amx() else _BF16_DECODE_KERNEL_MAX_KEYS
    return 512


def _prefill_in_decode_kernel(
    dtype: torch.dtype, query_len: int, seq_len: int, max_query_len: int
) -> bool:
    """Whether a prefill chunk runs faster through the decode kernel than through flash.

    The decode kernel takes each token of the chunk as a query of its own (its context ends at
    the token: causal), reading K/V in place with AVX-512 dot products; the flash route
    (_prefill_chunks: AMX tiles where the CPU has them, for bfloat16, else torch's CPU flash
    attention) runs GEMM tiles and pays for them on short chunks. max_query_len is
    decode_kernel_max_query_len's answer. Behind a context, a float32 chunk always takes flash
    (its call over the context is one dense GEMM: the decode kernel was 0.6-0.8x as fast
    there on a Zen 5); bfloat16 chunks take the decode kernel up to 1024 keys."""
    if query_len > max_query_len:
        return False
    if dtype == torch.bfloat16:
        return seq_len <= _BF16_DECODE_KERNEL_MAX_KEYS
    return query_len == seq_len


def fit_prefill_limit(timings: dict[int, tuple[float, float]]) -> int:
    """The longest probed length up to which the decode kernel never lost to flash, from
    {length: (decode kernel ms, flash ms)}; a tie keeps the decode kernel. Where it lost at
    the shortest probe, that length less one: shorter chunks keep the decode kernel."""
    limit = PREFILL_PROBE_LENS[0] - 1
    for length in sorted(timings):
        decode_ms, flash_ms = timings[length]
        if decode_ms > flash_ms:
            break
        limit = length
    return limit


def _time_prefill_routes(
    dtype: torch.dtype,
    length: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    rounds: int,
) -> tuple[float, float]:
    """(decode kernel ms, flash ms) of one first chunk of `length` tokens over random K/V,
    best of `rounds` interleaved after a warm-up round."""
    num_blocks = -(-length // block_size)
    key_cache = torch.randn(num_blocks + 1, block_size, num_kv_heads, head_size).to(dtype)
    value_cache = torch.randn_like(key_cache)
    block_ids = torch.arange(1, num_blocks + 1, dtype=torch.int32)
    query = torch.randn(length, num_heads, head_size).to(dtype)
    out = torch.empty_like(query)
    scale = head_size**-0.5

    def decode_route() -> None:
        _prefill_as_decodes(out, query, key_cache, value_cache, block_ids, 0, length, length, scale)

    table = block_ids.unsqueeze(0)
    query_start_loc = torch.tensor([0, length], dtype=torch.int32)
    seq_lens = torch.tensor([length], dtype=torch.int32)

    def flash_route() -> None:
        _prefill_chunks(
            out,
            query,
            key_cache,
            value_cache,
            table,
            query_start_loc,
            seq_lens,
            [0],
            [0, length],
            [length],
            scale,
        )

    best = [float("inf"), float("inf")]
    for _ in range(rounds + 1):  # the first round warms up (allocations, primitives)
        for i, route in enumerate((decode_route, flash_route)):
            start = time.perf_counter()
            route()
            best[i] = min(best[i], time.perf_counter() - start)
    return 1e3 * best[0], 1e3 * best[1]


def measure_prefill_route(
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    rounds: int = 3,
) -> tuple[int, dict[int, tuple[float, float]]]:
    """Time one first chunk of each PREFILL_PROBE_LENS length on both routes (the decode
    kernel, flash), best of `rounds` interleaved, until the decode kernel loses, and keep
    fit_prefill_limit's answer as this head layout's limit. Returns the limit and {length:
    (decode kernel ms, flash ms)} of the lengths timed. Random K/V in a cache of its own; the
    engine's cache is untouched."""
    timings: dict[int, tuple[float, float]] = {}
    for length in PREFILL_PROBE_LENS:
        timings[length] = _time_prefill_routes(
            dtype, length, num_heads, num_kv_heads, head_size, block_size, rounds
        )
        if timings[length][0] > timings[length][1]:
            break
    limit = fit_prefill_limit(timings)
    _DECODE_KERNEL_MAX_QUERY_LEN[(dtype, num_heads, num_kv_heads, head_size)] = limit
    return limit, timings


def _prefill_as_decodes(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_ids: torch.Tensor,
    start: int,
    end: int,
    seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    chunk_size: int | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """out[start:end] for one prefill chunk through the decode kernel: token i of the chunk is
    one query over keys [0, context_len + i], every token sharing the chunk's block-table row
    (a stride-0 view, no copy)."""
    query_len = end - start
    table = block_ids.unsqueeze(0).expand(query_len, -1)
    lens = torch.arange(seq_len - query_len + 1, seq_len + 1, dtype=torch.int32)
    rows = torch.arange(start, end, dtype=torch.int64)
    cpu.decode_attention(
        out,
        query,
        key_cache,
        value_cache,
        table,
        lens,
        rows,
        scale,
        sliding_window,
        soft_cap,
        chunk_size,
        sinks,
        k_scale,
        v_scale,
    )


def paged_attention_cpu(
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
    """The CPU fast path: decodes in the native kernel (K/V read in place, no gather);
    prefill chunks in the same kernel, a query per token, where that is faster
    (`_prefill_in_decode_kernel`) and whenever a window or soft cap is set, else the flash
    route (`_prefill_chunks`: all of them in one AMX call, or two flash SDPA calls each, the
    only choice with sinks). Same contract as `paged_attention`; the caller (kernels.dispatch)
    checks that the native kernel is built for the dtype."""
    _check_attention_args(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, max_seq_len
    )
    num_reqs = seq_lens.shape[0]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    if max_query_len == 1:  # a pure decode step: every request, in order
        decode_reqs = None
    else:
        bounds = torch.cat((query_start_loc, seq_lens)).tolist()
        starts, lens = bounds[: num_reqs + 1], bounds[num_reqs + 1 :]
        # A window, a soft cap or chunked local attention sends every chunk to the decode
        # kernel: the other choice is the reference's masked math path. Sinks go either way
        # (flash applies them from its log-sum-exps).
        windowed = bool(sliding_window or logits_soft_cap or attention_chunk_size)
        # Not true of the memory-profile pass's K/V views.
        in_place = cpu.kv_readable_in_place(key_cache, value_cache)
        max_decode_chunk = decode_kernel_max_query_len(
            query.dtype, query.shape[1], key_cache.shape[2], query.shape[2]
        )
        flash_reqs: list[int] = []  # the chunks for _prefill_chunks, all in one call
        for req in range(num_reqs):
            start, end = starts[req], starts[req + 1]
            if end - start <= 1:
                continue
            if in_place and (
                windowed
                or _prefill_in_decode_kernel(query.dtype, end - start, lens[req], max_decode_chunk)
            ):
                _prefill_as_decodes(
                    out,
                    query,
                    key_cache,
                    value_cache,
                    block_table[req],
                    start,
                    end,
                    lens[req],
                    scale,
                    sliding_window,
                    logits_soft_cap,
                    attention_chunk_size,
                    sinks,
                    k_scale,
                    v_scale,
                )
            elif windowed:
                out[start:end] = _prefill_attention_ref(
                    query[start:end],
                    key_cache,
                    value_cache,
                    block_table[req],
                    lens[req],
                    scale,
                    sliding_window=sliding_window,
                    soft_cap=logits_soft_cap,
                    chunk_size=attention_chunk_size,
                    sinks=sinks,
                    k_scale=k_scale,
                    v_scale=v_scale,
                )
            else:
                flash_reqs.append(req)
        if flash_reqs:
            _prefill_chunks(
                out,
                query,
                key_cache,
                value_cache,
                block_table,
                query_start_loc,
                seq_lens,
                flash_reqs,
                starts,
                lens,
                scale,
                sinks,
                k_scale,
                v_scale,
            )
        decode_reqs = (query_lens == 1).nonzero().squeeze(1)
        if decode_reqs.numel() == 0:
            return out
    table = block_table[:num_reqs]
    rows = query_start_loc[:num_reqs]
    lens_t = seq_lens
    if decode_reqs is not None:
        table = table.index_select(0, decode_reqs)
        rows = rows.index_select(0, decode_reqs)
        lens_t = seq_lens.index_select(0, decode_reqs)
    if table.stride(1) != 1:
        table = table.contiguous()
    cpu.decode_attention(
        out,
        query,
        key_cache,
        value_cache,
        table,
        lens_t,
        rows,
        scale,
        sliding_window,
        logits_soft_cap,
        attention_chunk_size,
        sinks,
        k_scale,
        v_scale,
    )
    return out
