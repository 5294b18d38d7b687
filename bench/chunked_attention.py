"""Decode attention of a Llama 4 chunked layer against a full-attention layer, on the CPU
paths the engine runs (kernels.paged_attention: the C decode kernel where it is built, else
the torch reference).

A decode at position p of a chunked layer reads only the keys of its own chunk,
p // C * C .. p, so its cost is bounded by the chunk size C whatever the context; a full
layer reads all p + 1 keys. Shapes are Llama 4 Scout's attention on one rank of TP = 8
(40 / 8 = 5 query heads, 8 / 8 = 1 KV head, head_dim 128), block_size 16, C = 8192 (the
released configs'). Each request sits at a random position of its context's last chunk.
Prints the best and median milliseconds per decode step of `--requests` requests.

    .venv/bin/python bench/chunked_attention.py [--requests 8] [--rounds 5] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve import kernels
from kvserve.kernels import cpu

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, CHUNK_SIZE = 5, 1, 128, 16, 8192
CONTEXTS = (2048, 8192, 16384, 32768)


def decode_inputs(num_reqs: int, context: int, dtype: torch.dtype, seed: int = 0):
    """Random decode-step arguments: num_reqs requests of about `context` tokens each."""
    generator = torch.Generator().manual_seed(seed)
    low = max(context - CHUNK_SIZE, 0) + 1
    seq_lens = torch.randint(low, context + 1, (num_reqs,), generator=generator).int()
    blocks_per_req = -(-context // BLOCK_SIZE)
    num_blocks = num_reqs * blocks_per_req + 1
    key_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE).to(dtype)
    value_cache = torch.randn_like(key_cache)
    block_table = (torch.randperm(num_blocks - 1, generator=generator) + 1).int()
    block_table = block_table.view(num_reqs, blocks_per_req).contiguous()
    query = torch.randn(num_reqs, NUM_HEADS, HEAD_SIZE).to(dtype)
    query_start_loc = torch.arange(num_reqs + 1, dtype=torch.int32)
    return query, key_cache, value_cache, block_table, query_start_loc, seq_lens


def time_ms(fn, rounds: int) -> tuple[float, float]:
    fn()  # warm-up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    path = "C decode kernel" if cpu.available(dtype) else "torch reference"
    print(
        f"{args.requests} decodes, {NUM_HEADS} q / {NUM_KV_HEADS} kv heads, head {HEAD_SIZE}, "
        f"{args.dtype}, {torch.get_num_threads()} threads, {path}; best / median ms per step"
    )
    print(f"{'context':>8} | {'full attention':>16} | {f'chunked C={CHUNK_SIZE}':>16} | ratio")
    for context in CONTEXTS:
        inputs = decode_inputs(args.requests, context, dtype)
        max_seq_len = int(inputs[-1].max())

        def step(chunk_size: int | None, inputs=inputs, max_seq_len=max_seq_len) -> None:
            scale = HEAD_SIZE**-0.5
            kernels.paged_attention(*inputs, scale, 1, max_seq_len, None, None, chunk_size)

        full = time_ms(lambda: step(None), args.rounds)
        chunked = time_ms(lambda: step(CHUNK_SIZE), args.rounds)
        print(
            f"{context:>8} | {full[0]:7.2f} / {full[1]:6.2f} | "
            f"{chunked[0]:7.2f} / {chunked[1]:6.2f} | {full[0] / chunked[0]:4.1f}x"
        )


if __name__ == "__main__":
    main()
