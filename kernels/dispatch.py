"""Pick the Triton kernel on CUDA tensors; on CPU the native C kernel (kernels/cpu.py) where
it is built for the dtype, else the torch reference."""

from __future__ import annotations

import torch

from kvserve.kernels import (
    activation,
    attention,
    attention_cpu,
    attention_ref,
    cache,
    cpu,
    gemm,
    norm,
    rotary,
)
from kvserve.kernels._triton import HAS_TRITON


def describe(device: torch.device, dtype: torch.dtype) -> str:
    """Which kernels serve `dtype` on `device`, in one line for the start-up log."""
    if device.type == "cuda":
        return "Triton kernels" + ("" if HAS_TRITON else " (not installed: they will fail)")
    if cpu.available(dtype):
        return cpu.status()
    reason = cpu.status() if dtype in cpu.DTYPES else f"no C kernel for {dtype}"
    return f"torch references ({reason})"


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda


def _use_cpu_kernel(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and cpu.available(t.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / rms(x) * weight over the last dim. x: [T, H]."""
    if _use_cpu_kernel(x):
        return cpu.rms_norm(x, weight, eps)
    return (norm.rms_norm if _use_triton(x) else norm.rms_norm_ref)(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual = x + residual; return (rms_norm(residual), residual)."""
    if _use_cpu_kernel(x):
        return cpu.rms_norm(x, weight, eps, residual)
    fn = norm.fused_add_rms_norm if _use_triton(x) else norm.fused_add_rms_norm_ref
    return fn(x, residual, weight, eps)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding.

    positions: [T] int64; query: [T, Hq * D]; key: [T, Hkv * D];
    cos_sin_cache: [max_position, D] float32, cos in the first D/2 columns, sin in the rest.
    Returns the rotated (query, key), same shapes and dtype.
    """
    if _use_cpu_kernel(query):
        return cpu.rotary_embedding(positions, query, key, cos_sin_cache, head_size)
    fn = rotary.rotary_embedding if _use_triton(query) else rotary.rotary_embedding_ref
    return fn(positions, query, key, cos_sin_cache, head_size)


def rotary_write_kv_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """rotary_embedding of query and key, then write_kv_cache of the rotated key and value;
    returns the rotated query [T, Hq * D]. On CPU one C pass: the rotated key is written
    only into the cache. Elsewhere (or caches the C pass does not write, fp8 ones among
    them) the two ops.

    query: [T, Hq * D]; key, value: [T, Hkv * D]; the caches, slot_mapping and cos_sin_cache
    as in write_kv_cache and rotary_embedding.
    """
    if _use_cpu_kernel(query) and key_cache.dtype == query.dtype:
        rotated = cpu.rotary_write_kv_cache(
            positions,
            query,
            key,
            value,
            cos_sin_cache,
            head_size,
            key_cache,
            value_cache,
            slot_mapping,
        )
        if rotated is not None:
            return rotated
    query, key = rotary_embedding(positions, query, key, cos_sin_cache, head_size)
    num_tokens, num_kv_heads = key.shape[0], key.shape[1] // head_size
    write_kv_cache(
        key.view(num_tokens, num_kv_heads, head_size),
        value.view(num_tokens, num_kv_heads, head_size),
        key_cache,
        value_cache,
        slot_mapping,
        k_scale,
        v_scale,
    )
    return query


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] = [gate | up]; returns silu(gate) * up, [T, I]."""
    if _use_cpu_kernel(x):
        return cpu.silu_and_mul(x)
    return (activation.silu_and_mul if _use_triton(x) else activation.silu_and_mul_ref)(x)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) as int64: the C kernel for 2-D CPU rows (torch's CPU argmax is ~10x
    slower on a step's [R, vocab] logits), else torch's."""
    if _use_cpu_kernel(x):
        picked = cpu.argmax(x)
        if picked is not None:
            return picked
    return x.argmax(dim=-1)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    prepared: gemm.LinearWeights | None = None,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x W^T + b (+ add, [T, N]: a residual). On CPU, the GEMM path the layer's measured
    plan names (kernels/gemm.py), with the add fused into it where `linear_fuses_add` says;
    elsewhere F.linear (cuBLAS), then the add."""
    if prepared is not None and x.device.type == "cpu":
        return gemm.linear(x, weight, bias, prepared, add)
    y = torch.nn.functional.linear(x, weight, bias)
    return y if add is None else y + add


def linear_fuses_add(
    x_device: torch.device, prepared: gemm.LinearWeights | None, num_rows: int
) -> bool:
    """Whether linear(..., add=) of num_rows rows adds inside the GEMM (no pass of its own)."""
    return x_device.type == "cpu" and gemm.adds_in_place_of_output(prepared, num_rows)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter K/V of T tokens into the paged cache, in place.

    key, value: [T, Hkv, D]; key_cache, value_cache: [num_blocks, block_size, Hkv, D];
    slot_mapping: [T] int64, slot = block_id * block_size + offset; a slot < 0 is skipped.
    An fp8 cache (kernels/cache.py) gets key / k_scale and value / v_scale, rounded to it.
    """
    on_cpu_kernel = _use_cpu_kernel(key)
    if cache.is_fp8(key_cache.dtype) and key.dtype != key_cache.dtype:
        key = cache.quantize_kv(key, k_scale, key_cache.dtype)
        value = cache.quantize_kv(value, v_scale, value_cache.dtype)
    if on_cpu_kernel:
        cache._check_kv_cache_args(key, value, key_cache, value_cache, slot_mapping)
        if cpu.write_kv_cache(key, value, key_cache, value_cache, slot_mapping):
            return
    fn = cache.write_kv_cache if _use_triton(key) else cache.write_kv_cache_ref
    fn(key, value, key_cache, value_cache, slot_mapping)


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
    """Causal attention of flattened varlen queries over K/V read through a block table.

    query: [T, Hq, D], the new tokens of R requests laid end to end.
    key_cache, value_cache: [num_blocks, block_size, Hkv, D] (already holding this step's K/V).
    block_table: [R, max_blocks] int32; query_start_loc: [R + 1] int32 (cumulative query lens);
    seq_lens: [R] int32, tokens in context after this step. Query token j of request r sits at
    position seq_lens[r] - query_len[r] + j and sees keys 0..that position.
    max_query_len, max_seq_len: host-side maxima of the two (avoid a device sync).
    sliding_window: if set, a query at position p sees only keys p - sliding_window < t <= p
        (older blocks stay in the cache, masked).
    logits_soft_cap: if set, each score s (scale included) becomes cap * tanh(s / cap)
        before the softmax (Gemma 2).
    attention_chunk_size: if set, a query at position p sees only the keys of its own chunk,
        p // C * C <= t <= p (Llama 4's chunked local attention).
    sinks: if set, [Hq] float32, one logit per query head that joins each softmax's
        denominator with no value (gpt-oss): out = sum_t e^s_t v_t / (e^sink + sum_t e^s_t).
    k_scale, v_scale: an fp8 cache's scales (kernels/cache.py): every path reads
        k_scale * K and v_scale * V; float caches ignore them.
    Returns [T, Hq, D]. Hq must be a multiple of Hkv (GQA).
    """
    # Float caches keep the call they always had (the scales are an fp8 cache's only).
    fp8_scales = {"k_scale": k_scale, "v_scale": v_scale} if cache.is_fp8(key_cache.dtype) else {}
    if _use_triton(query):
        fn = attention.paged_attention
    elif _use_cpu_kernel(query):
        fn = attention_cpu.paged_attention_cpu
    else:
        fn = attention_ref.paged_attention_ref
    return fn(
        query,
        key_cache,
        value_cache,
        block_table,
        query_start_loc,
        seq_lens,
        scale,
        max_query_len,
        max_seq_len,
        sliding_window,
        logits_soft_cap,
        attention_chunk_size,
        sinks,
        **fp8_scales,
    )
