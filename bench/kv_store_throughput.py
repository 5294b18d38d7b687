"""Put and get throughput of the KV store's arena path against a plain memcpy.

Starts `kvserve kv-store` on an ipc:// address, fills a paged KV cache of the default model's
layout (SmolLM2-135M: 30 layers, 3 KV heads of 64, blocks of 16 tokens, float32), then times

    memcpy  one torch copy_ of the same bytes, in this process (the ceiling)
    put     KvStoreClient.put: reserve, copy cache -> arena slots, commit
    get     KvStoreClient.get: get the slots, copy arena -> cache, release

and prints GB/s for each and its ratio to memcpy (the issue's target: at least 0.5).

    .venv/bin/python bench/kv_store_throughput.py [--num-blocks 256] [--repeats 5] [--tcp]
        [--threads N] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid

import torch

from kvserve.services.kv_store.client import KvStoreClient
from kvserve.shared.messages import KvFingerprint


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch page faults of the arena and the caches
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def _time_store(address, fp, src, dst, block_ids, repeats) -> list[tuple[str, float]]:
    """(name, best seconds) of a put and a get of block_ids through the store at address."""
    n = len(block_ids)
    client = KvStoreClient(address, fp, timeout_s=30)
    kind = "arena" if client.use_arena else "tcp frames"
    rounds = iter(range(10**6))
    batches: list[list[bytes]] = []

    def put() -> None:
        # New hashes each time: a put of held blocks would copy nothing.
        batches.append([f"{kind}-{next(rounds)}-{i}".encode() for i in range(n)])
        assert client.put(batches[-1], src, block_ids) == n

    put_s = _best_seconds(put, repeats)
    hashes = batches[-1]
    get_s = _best_seconds(lambda: client.get(hashes, dst, block_ids), repeats)
    assert all(torch.equal(d[:, block_ids], s[:, block_ids]) for s, d in zip(src, dst))
    client.close()
    return [(f"put via {kind}", put_s), (f"get via {kind}", get_s)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-blocks", type=int, default=256, help="blocks per put / get")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs (best counts)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tcp", action="store_true", help="also time frames over tcp://")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: its own)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    fp = KvFingerprint(
        model="SmolLM2-135M-Instruct",
        dtype=args.dtype,
        block_size=16,
        num_layers=30,
        num_kv_heads=3,
        head_size=64,
    )
    n = args.num_blocks
    num_cache_blocks = 2 * n  # the ids are a random half of the cache, as a scheduler hands out
    dtype = getattr(torch, args.dtype)
    shape = (2, num_cache_blocks, fp.block_size, fp.num_kv_heads, fp.head_size)
    src = [torch.randn(shape).to(dtype) for _ in range(fp.num_layers)]
    dst = [torch.zeros_like(cache) for cache in src]
    block_ids = torch.randperm(num_cache_blocks)[:n].tolist()
    total_bytes = n * fp.block_bytes

    flat_src = torch.randn(total_bytes // 4).view(dtype)
    flat_dst = torch.empty_like(flat_src)
    memcpy_s = _best_seconds(lambda: flat_dst.copy_(flat_src), args.repeats)

    base = os.path.join(tempfile.gettempdir(), f"kvserve-kvbench-{uuid.uuid4().hex[:8]}")
    addresses = [f"ipc://{base}"] + (["tcp://127.0.0.1:55771"] if args.tcp else [])
    # Room for two batches: each put evicts the one before last and reuses its slots, so the
    # timed puts measure copies into touched memory, as in a full store, not page faults.
    size = str(2 * total_bytes + fp.block_bytes)
    store = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "kv-store", "--address", ",".join(addresses)]
        + ["--size", size]
    )
    results = [("memcpy (torch copy_)", memcpy_s)]
    try:
        for address in addresses:
            results += _time_store(address, fp, src, dst, block_ids, args.repeats)
    finally:
        store.terminate()
        store.wait(10)

    print(
        f"{n} blocks of {fp.block_bytes / 2**10:.0f} KiB ({total_bytes / 2**20:.0f} MiB), "
        f"{args.dtype}, torch threads {torch.get_num_threads()}"
    )
    for name, seconds in results:
        ratio = memcpy_s / seconds
        print(f"  {name:22s} {total_bytes / seconds / 1e9:6.2f} GB/s  {ratio:5.2f} x memcpy")


if __name__ == "__main__":
    main()
