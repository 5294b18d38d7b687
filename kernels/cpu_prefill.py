"""The two routes a prefill chunk takes on the CPU fast path (kernels/attention_cpu.py).

- The decode kernel (`prefill_as_decodes`): token i of the chunk is one query of its own over
  keys [0, context_len + i], K/V read in place with AVX-512 dot products.
- The flash route (`prefill_chunks`): AMX tiles where the CPU has them (bfloat16), else torch's
  CPU flash attention, two calls per chunk merged by their log-sum-exps.

Which one a chunk takes is kernels/prefill_route.py's choice.
"""

from __future__ import annotations

import torch

from kvserve.kernels import cpu
from kvserve.kernels.cache import dequantize_kv


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


def prefill_chunks(
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


def prefill_as_decodes(
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
