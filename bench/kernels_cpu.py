"""Micro-benchmarks of the CPU kernel references (the CPU engine's hot path).

Shapes are SmolLM2-135M's: hidden 576, 9 query heads, 3 KV heads, head_dim 64, intermediate
1536, block_size 16. Prints the best and median milliseconds per call over several timed
rounds (best is the stable number on a shared machine), for float32 and bfloat16, plus the
old per-request-loop attention as a baseline, and the CPU fast path the engine runs
(`paged_attention_cpu`: decodes in the C kernel, prefill chunks in it too or through the
flash route, kernels.prefill_route.prefill_in_decode_kernel) on the prefill step of the
concurrency-32 workload and others, with the prefill's GFLOP/s on each route (torch's flash,
the AMX kernel where bfloat16 runs on AMX tiles, the decode kernel).

    .venv/bin/python bench/kernels_cpu.py [--threads N] [--rounds N] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from kvserve.kernels import cpu, cpu_prefill
from kvserve.kernels.activation import silu_and_mul_ref
from kvserve.kernels.attention_cpu import paged_attention_cpu
from kvserve.kernels.attention_ref import paged_attention_ref
from kvserve.kernels.cache import write_kv_cache_ref
from kvserve.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from kvserve.kernels.rotary import rotary_embedding_ref

HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, INTERMEDIATE = 576, 9, 3, 64, 1536
BLOCK_SIZE, MAX_POSITION = 16, 8192


def time_ms(
    fn: Callable[[], object], rounds: int, min_round_s: float = 0.02
) -> tuple[float, float]:
    """(best, median) milliseconds per call; each round repeats fn for >= min_round_s."""
    fn()  # warm-up: first-call allocations, oneDNN primitive creation
    start = time.perf_counter()
    fn()
    calls = max(1, int(min_round_s / max(time.perf_counter() - start, 1e-6)))
    per_call = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - start) / calls * 1e3)
    return min(per_call), statistics.median(per_call)


def attention_inputs(query_and_seq_lens: list[tuple[int, int]], dtype: torch.dtype):
    """Random paged-attention arguments; every request's blocks scattered through the cache."""
    blocks_per_req = [-(-seq_len // BLOCK_SIZE) for _, seq_len in query_and_seq_lens]
    num_blocks = sum(blocks_per_req) + 1
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    key_cache = torch.randn(cache_shape).to(dtype)
    value_cache = torch.randn(cache_shape).to(dtype)
    block_ids = torch.randperm(num_blocks - 1) + 1
    block_table = torch.zeros(len(blocks_per_req), max(blocks_per_req), dtype=torch.int32)
    start = 0
    for req, num_req_blocks in enumerate(blocks_per_req):
        block_table[req, :num_req_blocks] = block_ids[start : start + num_req_blocks]
        start += num_req_blocks
    query_lens = [query_len for query_len, _ in query_and_seq_lens]
    query = torch.randn(sum(query_lens), NUM_HEADS, HEAD_SIZE).to(dtype)
    query_start_loc = torch.tensor([0] + query_lens).cumsum(0).int()
    seq_lens = torch.tensor([seq_len for _, seq_len in query_and_seq_lens], dtype=torch.int32)
    return (
        query,
        key_cache,
        value_cache,
        block_table,
        query_start_loc,
        seq_lens,
        HEAD_SIZE**-0.5,
        max(query_lens),
        int(seq_lens.max()),
    )


def loop_baseline(
    query,
    key_cache,
    value_cache,
    block_table,
    query_start_loc,
    seq_lens,
    scale,
    max_query_len,
    max_seq_len,
):
    """The first reference: one SDPA per request, K/V expanded with repeat_interleave."""
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for req, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[req], starts[req + 1]
        blocks = block_table[req, : -(-seq_len // BLOCK_SIZE)].long()
        keys = key_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1)
        values = value_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1)
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=0)
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=0)
        positions = torch.arange(seq_len - (end - start), seq_len).unsqueeze(1)
        mask = torch.arange(seq_len).unsqueeze(0) <= positions
        out[start:end] = F.scaled_dot_product_attention(
            query[start:end].transpose(0, 1), keys, values, attn_mask=mask, scale=scale
        ).transpose(0, 1)
    return out


def bench_attention(dtype: torch.dtype, rounds: int) -> None:
    cases = {
        "64 decodes @ ctx 300": [(1, 300)] * 64,
        "64 decodes @ ctx 100..1000": [(1, 100 + 14 * i) for i in range(64)],
        "1 prefill, 256 tokens": [(256, 256)],
        "1 chunk 256 @ ctx 512": [(256, 512)],
        "mixed: 32 decodes @ 300 + chunk 128 @ 384": [(1, 300)] * 32 + [(128, 384)],
    }
    for name, layout in cases.items():
        args = attention_inputs(layout, dtype)
        torch.testing.assert_close(
            paged_attention_ref(*args).float(), loop_baseline(*args).float(), atol=2e-2, rtol=2e-2
        )
        best, median = time_ms(partial(paged_attention_ref, *args), rounds)
        base_best, _ = time_ms(partial(loop_baseline, *args), max(rounds // 2, 1))
        print(
            f"  paged_attention_ref  {name:42s} {best:8.3f} ms (median {median:7.3f})"
            f"   loop baseline {base_best:8.3f} ms  x{base_best / best:4.1f}"
        )


def prefill_routes(args) -> dict[str, Callable[[], object]]:
    """The ways paged_attention_cpu can run the prefill chunks of `args`: torch's flash chunk by
    chunk, the AMX kernel all at once (bfloat16, where the CPU has AMX tiles), the decode
    kernel a query per token."""
    query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale = args[:7]
    chunks = [
        (req, int(start), int(end), int(seq_len))
        for req, (start, end, seq_len) in enumerate(
            zip(query_start_loc[:-1], query_start_loc[1:], seq_lens)
        )
        if end - start > 1
    ]
    out = torch.empty_like(query)

    def torch_flash() -> None:
        for req, start, end, seq_len in chunks:
            out[start:end] = cpu_prefill._prefill_attention_cpu(
                query[start:end], key_cache, value_cache, block_table[req], seq_len, scale
            )

    def amx() -> None:
        reqs = [req for req, *_ in chunks]
        assert cpu.prefill_attention_amx(
            out, query, key_cache, value_cache, block_table, query_start_loc, seq_lens, reqs, scale
        )

    def decode_kernel() -> None:
        for req, start, end, seq_len in chunks:
            cpu_prefill.prefill_as_decodes(
                out, query, key_cache, value_cache, block_table[req], start, end, seq_len, scale
            )

    routes = {"torch flash": torch_flash, "decode kernel": decode_kernel}
    if query.dtype == torch.bfloat16 and cpu.cpu_has_amx():
        routes["AMX"] = amx
    return routes


def bench_attention_cpu(dtype: torch.dtype, rounds: int) -> None:
    cases = {
        "8 prefills of 256 (a 2048-token step)": [(256, 256)] * 8,
        "32 decodes @ 300 + 7 prefills of 256": [(1, 300)] * 32 + [(256, 256)] * 7,
        "32 decodes @ ctx 300": [(1, 300)] * 32,
        "32 prefills of 64": [(64, 64)] * 32,
        "4 prefills of 512": [(512, 512)] * 4,
        "1 prefill of 1024": [(1024, 1024)],
        "1 prefill of 2048": [(2048, 2048)],
        "4 chunks 256 @ ctx 256": [(256, 512)] * 4,
        "2 chunks 256 @ ctx 768": [(256, 1024)] * 2,
        "1 chunk 256 @ ctx 1792": [(256, 2048)],
        "1 chunk 2048 @ ctx 5482 (a 7,530-token prompt's last)": [(2048, 7530)],
    }
    for name, layout in cases.items():
        args = attention_inputs(layout, dtype)
        best, median = time_ms(partial(paged_attention_cpu, *args), rounds)
        line = f"  paged_attention_cpu  {name:38s} {best:8.3f} ms (median {median:7.3f})"
        if any(q > 1 for q, _ in layout):
            # QK and PV: the causal half of each chunk's square plus its whole context
            flop = sum(4 * q * (s - q + (q + 1) / 2) * HEAD_SIZE * NUM_HEADS for q, s in layout)
            line += "   prefill:"
            for route, fn in prefill_routes(args).items():
                ms, _ = time_ms(fn, rounds)
                line += f" {route} {ms:7.3f} ms ({flop / ms / 1e6:4.0f} GFLOP/s),"
        print(line.rstrip(","))


def bench_elementwise(dtype: torch.dtype, rounds: int) -> None:
    cos_sin_cache = torch.randn(MAX_POSITION, HEAD_SIZE)
    q_size, kv_size = NUM_HEADS * HEAD_SIZE, NUM_KV_HEADS * HEAD_SIZE
    for num_tokens in (64, 256):
        x = torch.randn(num_tokens, HIDDEN).to(dtype)
        residual = torch.randn(num_tokens, HIDDEN).to(dtype)
        weight = torch.randn(HIDDEN).to(dtype)
        qkv = torch.randn(num_tokens, q_size + 2 * kv_size).to(dtype)
        query, key = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]
        positions = torch.randint(0, MAX_POSITION, (num_tokens,))
        gate_up = torch.randn(num_tokens, 2 * INTERMEDIATE).to(dtype)
        kv_cache = torch.zeros(2, 2048, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype=dtype)
        slots = torch.randperm(2048 * BLOCK_SIZE)[:num_tokens]
        new_kv = qkv[:, q_size:].view(num_tokens, 2, NUM_KV_HEADS, HEAD_SIZE)
        ops = {
            "rms_norm_ref": partial(rms_norm_ref, x, weight, 1e-5),
            "fused_add_rms_norm_ref": partial(fused_add_rms_norm_ref, x, residual, weight, 1e-5),
            "rotary_embedding_ref": partial(
                rotary_embedding_ref, positions, query, key, cos_sin_cache, HEAD_SIZE
            ),
            "silu_and_mul_ref": partial(silu_and_mul_ref, gate_up),
            "write_kv_cache_ref": partial(
                write_kv_cache_ref, new_kv[:, 0], new_kv[:, 1], kv_cache[0], kv_cache[1], slots
            ),
        }
        for name, fn in ops.items():
            best, median = time_ms(fn, rounds)
            print(f"  {name:22s} T={num_tokens:<4d} {best:8.3f} ms (median {median:7.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per op")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        action="append",
        help="dtype(s) to run (default: both)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for dtype_name in args.dtype or ["float32", "bfloat16"]:
        dtype = getattr(torch, dtype_name)
        print(f"[{dtype_name}]")
        bench_attention(dtype, args.rounds)
        bench_attention_cpu(dtype, args.rounds)
        bench_elementwise(dtype, args.rounds)


if __name__ == "__main__":
    main()
