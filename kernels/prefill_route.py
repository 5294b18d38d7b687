"""Which route a CPU prefill chunk takes (kernels/cpu_prefill.py): the decode kernel or flash.

The limits are defaults measured in bench/RESULTS.md, or timed on this CPU at start-up for the
model's head layout (`measure_prefill_route`, KVSERVE_PREFILL_ROUTE_MEASURE).
"""

from __future__ import annotations

import time

import torch

from kvserve.kernels import cpu
from kvserve.kernels.cpu_prefill import prefill_as_decodes, prefill_chunks

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


def prefill_in_decode_kernel(
    dtype: torch.dtype, query_len: int, seq_len: int, max_query_len: int
) -> bool:
    """Whether a prefill chunk runs faster through the decode kernel than through flash.

    The decode kernel takes each token of the chunk as a query of its own (its context ends at
    the token: causal), reading K/V in place with AVX-512 dot products; the flash route
    (prefill_chunks: AMX tiles where the CPU has them, for bfloat16, else torch's CPU flash
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
        prefill_as_decodes(out, query, key_cache, value_cache, block_ids, 0, length, length, scale)

    table = block_ids.unsqueeze(0)
    query_start_loc = torch.tensor([0, length], dtype=torch.int32)
    seq_lens = torch.tensor([length], dtype=torch.int32)

    def flash_route() -> None:
        prefill_chunks(
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
