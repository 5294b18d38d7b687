"""Torch paged attention: the reference every other path is tested against, and the CPU path
where the native kernel is not built.

Same contract and options as the Triton kernel (kernels/attention.py's module docstring).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.kernels.attention import check_attention_args
from kvserve.kernels.cache import dequantize_kv

# Bytes of padded K + V one decode group of the torch reference may gather. Bounded so the
# temporaries come from the allocator's heap instead of fresh page-faulted mmaps (4x slower
# on a 50 MB gather) and stay nearer the CPU caches: ~10k tokens of SmolLM2 K/V in fp32.
_DECODE_GROUP_BYTES = 16 << 20

# (sliding_window, soft_cap, chunk_size, sinks, k_scale, v_scale): the options as the
# per-request helpers here and in the CPU path take them, in this order.
AttentionOptions = tuple[int | None, float | None, int | None, torch.Tensor | None, float, float]


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


def prefill_attention_ref(
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
    check_attention_args(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, max_seq_len
    )
    num_reqs = seq_lens.shape[0]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    bounds = torch.cat((query_start_loc, seq_lens)).tolist()  # the one host read
    query_starts, req_seq_lens = bounds[: num_reqs + 1], bounds[num_reqs + 1 :]
    options = (sliding_window, logits_soft_cap, attention_chunk_size, sinks, k_scale, v_scale)
    decode_reqs: list[int] = []
    for req, seq_len in enumerate(req_seq_lens):
        start, end = query_starts[req], query_starts[req + 1]
        if end - start == 1:
            decode_reqs.append(req)
        elif end > start:
            out[start:end] = prefill_attention_ref(
                query[start:end], key_cache, value_cache, block_table[req], seq_len, scale, *options
            )
    return _decode_groups_ref(
        out, query, key_cache, value_cache, block_table, seq_lens, query_starts, req_seq_lens,
        decode_reqs, scale, options,
    )  # fmt: skip


def _decode_groups_ref(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_starts: list[int],
    req_seq_lens: list[int],
    decode_reqs: list[int],
    scale: float,
    options: AttentionOptions,
) -> torch.Tensor:
    """out with the rows of `decode_reqs` filled, one batched SDPA per group of similar length
    (_group_decodes). A step of decodes only, in order and in one group, returns that group's
    output itself (no index shuffles)."""
    num_reqs = seq_lens.shape[0]
    block_size, num_kv_heads, head_size = key_cache.shape[1:]
    max_group_tokens = _DECODE_GROUP_BYTES // (
        2 * num_kv_heads * head_size * key_cache.element_size()
    )
    for group in _group_decodes(decode_reqs, req_seq_lens, block_size, max_group_tokens):
        num_blocks = -(-req_seq_lens[group[0]] // block_size)  # longest first
        if len(group) == num_reqs == query.shape[0] and group == list(range(num_reqs)):
            # All decodes, in order, one group (the common decode step): no index shuffles.
            return _decode_attention_ref(
                query, key_cache, value_cache, block_table[:num_reqs], seq_lens, scale, num_blocks,
                *options,
            )  # fmt: skip
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
            *options,
        )
        out.index_copy_(0, token_indices, group_out)
    return out
