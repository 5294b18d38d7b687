"""The CPU fast path of paged attention: the native kernel (kernels/csrc via kernels.cpu).

Same contract and options as the Triton kernel (kernels/attention.py's module docstring).
"""

from __future__ import annotations

import torch

from kvserve.kernels import cpu
from kvserve.kernels.attention import check_attention_args
from kvserve.kernels.attention_ref import AttentionOptions, prefill_attention_ref
from kvserve.kernels.cpu_prefill import prefill_as_decodes, prefill_chunks
from kvserve.kernels.prefill_route import decode_kernel_max_query_len, prefill_in_decode_kernel


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
    (`prefill_in_decode_kernel`) and whenever a window or soft cap is set, else the flash
    route (`prefill_chunks`: all of them in one AMX call, or two flash SDPA calls each, the
    only choice with sinks). Same contract as `paged_attention`; the caller (kernels.dispatch)
    checks that the native kernel is built for the dtype."""
    check_attention_args(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, max_seq_len
    )
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    options = (sliding_window, logits_soft_cap, attention_chunk_size, sinks, k_scale, v_scale)
    decode_reqs = None  # a pure decode step (max_query_len 1): every request, in order
    if max_query_len != 1:
        _prefills(
            out, query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale,
            options,
        )  # fmt: skip
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        decode_reqs = (query_lens == 1).nonzero().squeeze(1)
        if decode_reqs.numel() == 0:
            return out
    _decodes(
        out, query, key_cache, value_cache, block_table, query_start_loc, seq_lens, decode_reqs,
        scale, options,
    )  # fmt: skip
    return out


def _prefills(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    options: AttentionOptions,
) -> None:
    """out's rows of every prefill chunk (query_len > 1), each by its route: the decode kernel
    (a query per token), the reference's masked math (a window or soft cap over K/V the kernel
    cannot read in place), or flash (every such chunk in one prefill_chunks call)."""
    num_reqs = seq_lens.shape[0]
    bounds = torch.cat((query_start_loc, seq_lens)).tolist()
    starts, lens = bounds[: num_reqs + 1], bounds[num_reqs + 1 :]
    # A window, a soft cap or chunked local attention sends every chunk to the decode
    # kernel: the other choice is the reference's masked math path. Sinks go either way
    # (flash applies them from its log-sum-exps).
    sliding_window, logits_soft_cap, attention_chunk_size = options[:3]
    windowed = bool(sliding_window or logits_soft_cap or attention_chunk_size)
    # Not true of the memory-profile pass's K/V views.
    in_place = cpu.kv_readable_in_place(key_cache, value_cache)
    max_decode_chunk = decode_kernel_max_query_len(
        query.dtype, query.shape[1], key_cache.shape[2], query.shape[2]
    )
    flash_reqs: list[int] = []  # the chunks for prefill_chunks, all in one call
    for req in range(num_reqs):
        start, end = starts[req], starts[req + 1]
        if end - start <= 1:
            continue
        if in_place and (
            windowed
            or prefill_in_decode_kernel(query.dtype, end - start, lens[req], max_decode_chunk)
        ):
            prefill_as_decodes(
                out, query, key_cache, value_cache, block_table[req], start, end, lens[req], scale,
                *options,
            )  # fmt: skip
        elif windowed:
            out[start:end] = prefill_attention_ref(
                query[start:end], key_cache, value_cache, block_table[req], lens[req], scale,
                *options,
            )  # fmt: skip
        else:
            flash_reqs.append(req)
    if flash_reqs:
        prefill_chunks(
            out, query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
            flash_reqs, starts, lens, scale, *options[3:],
        )  # fmt: skip


def _decodes(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    decode_reqs: torch.Tensor | None,
    scale: float,
    options: AttentionOptions,
) -> None:
    """out's rows of the decodes, in the native kernel: those of `decode_reqs`, or of every
    request where it is None (a pure decode step: no index shuffles)."""
    num_reqs = seq_lens.shape[0]
    table = block_table[:num_reqs]
    rows = query_start_loc[:num_reqs]
    lens_t = seq_lens
    if decode_reqs is not None:
        table = table.index_select(0, decode_reqs)
        rows = rows.index_select(0, decode_reqs)
        lens_t = seq_lens.index_select(0, decode_reqs)
    if table.stride(1) != 1:
        table = table.contiguous()
    cpu.decode_attention(out, query, key_cache, value_cache, table, lens_t, rows, scale, *options)
