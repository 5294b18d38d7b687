"""Throughput of the KV store's disk tier, and how long a restarted store takes to rebuild its
index.

Starts `kvserve kv-store --disk-path DIR` (DIR on a real disk, --folder) with a memory tier of
--mem-blocks blocks of the default model's layout (SmolLM2-135M: 30 layers, 3 KV heads of 64,
blocks of 16 tokens, float32: 720 KiB), then times

    spill      puts of --num-blocks blocks through the small memory tier: each evicts an
               older block, which the writer thread writes to disk (until none is pending)
    pin        a pin with a TTL of --mem-blocks held blocks: written through, fsynced
    get warm   gets of the spilled blocks: each read from its file, verified, promoted
    get cold   the same after the files left the page cache (posix_fadvise DONTNEED)
    rebuild    the index rebuilt from the folder (DiskTier.scan, as a restarted store does),
               warm and with the headers out of the page cache; with --rebuild-files N, also
               for a folder of N small block files (the scan's cost is per file)

and prints MB/s (and the rebuild's seconds).

    .venv/bin/python bench/kv_store_disk.py [--num-blocks 512] [--mem-blocks 64]
        [--folder /var/tmp] [--threads 1] [--rebuild-files 10000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

import torch

from kvserve.services.kv_store.client import KvStoreClient
from kvserve.services.kv_store.disk_format import block_path, pack_header
from kvserve.services.kv_store.disk_tier import DiskTier
from kvserve.shared.messages import KvFingerprint

_FP = KvFingerprint(
    model="SmolLM2-135M-Instruct",
    dtype="float32",
    block_size=16,
    num_layers=30,
    num_kv_heads=3,
    head_size=64,
)
_BATCH = 32  # blocks per put / get, a few requests' worth


def _wait_written(client: KvStoreClient) -> None:
    while client.stats().disk_pending_writes:
        time.sleep(0.005)


def _drop_page_cache(root: str) -> None:
    os.sync()  # dirty pages are not dropped
    for folder, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def _rate(num_blocks: int, seconds: float) -> str:
    mb_per_s = num_blocks * _FP.block_bytes / seconds / 1e6
    return f"{mb_per_s:8.1f} MB/s  ({num_blocks} blocks, {seconds:.3f} s)"


def _time_tiers(client: KvStoreClient, args: argparse.Namespace, root: str) -> list[str]:
    caches = [torch.randn(2, _BATCH, 16, 3, 64) for _ in range(_FP.num_layers)]
    ids = list(range(_BATCH))
    spilled = [
        [f"spill-{b}-{i}".encode() for i in range(_BATCH)] for b in range(args.num_blocks // _BATCH)
    ]
    started = time.perf_counter()
    for hashes in spilled:
        assert client.put(hashes, caches, ids) == _BATCH
    _wait_written(client)
    lines = [f"spill     {_rate(len(spilled) * _BATCH, time.perf_counter() - started)}"]
    pinned = [f"pin-{i}".encode() for i in range(min(args.mem_blocks // 2, _BATCH))]
    assert client.put(pinned, caches, ids[: len(pinned)]) == len(pinned)
    started = time.perf_counter()
    client.unpin(client.pin(pinned, ttl_s=3600))
    _wait_written(client)
    lines.append(f"pin       {_rate(len(pinned), time.perf_counter() - started)}")
    for label, cold in (("get warm", False), ("get cold", True)):
        victims = spilled[: len(spilled) // 2] if not cold else spilled[len(spilled) // 2 :]
        if cold:
            _drop_page_cache(root)
        started = time.perf_counter()
        for hashes in victims:
            assert client.get(hashes, caches, ids) == _BATCH, client.stats()
        lines.append(f"{label}  {_rate(len(victims) * _BATCH, time.perf_counter() - started)}")
    return lines


def _write_small_files(root: str, num_files: int) -> None:
    """num_files block files of 1 KiB payloads, written as the writer thread writes them."""
    fp_key, payload = b"k" * 16, os.urandom(1024)
    os.makedirs(os.path.join(root, fp_key.hex()))
    for i in range(num_files):
        block_hash = i.to_bytes(32, "little")
        with open(block_path(root, fp_key, block_hash), "wb") as f:
            f.write(pack_header(fp_key, block_hash, payload, 0.0))
            f.write(payload)


def _time_rebuild(root: str) -> list[str]:
    lines = []
    for label, cold in (("warm", False), ("cold", True)):
        if cold:
            _drop_page_cache(root)
        started = time.perf_counter()
        disk = DiskTier(root, 1 << 50)
        disk.scan()
        seconds = time.perf_counter() - started
        lines.append(f"rebuild {label}  {seconds:.3f} s for {len(disk.blocks)} files")
        disk.close()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-blocks", type=int, default=512, help="blocks spilled to disk")
    parser.add_argument("--mem-blocks", type=int, default=64, help="blocks the memory tier holds")
    parser.add_argument("--folder", default="/var/tmp", help="where the disk tier's folder goes")
    parser.add_argument("--threads", type=int, default=1, help="this process's torch threads")
    parser.add_argument("--rebuild-files", type=int, default=0, help="small files to scan too")
    args = parser.parse_args()
    # One thread: idle OpenMP workers spin, and would take the store's core on a small machine.
    torch.set_num_threads(args.threads)
    root = os.path.join(args.folder, f"kvserve-diskbench-{uuid.uuid4().hex[:8]}")
    address = f"ipc://{os.path.join(tempfile.gettempdir(), os.path.basename(root))}"
    command = [sys.executable, "-m", "kvserve.cli", "kv-store", "--address", address]
    command += ["--size", str(args.mem_blocks * _FP.block_bytes), "--disk-path", root]
    command += ["--disk-bytes", str(4 * args.num_blocks * _FP.block_bytes)]
    store = subprocess.Popen(command)
    try:
        client = KvStoreClient(address, _FP, timeout_s=60)
        lines = _time_tiers(client, args, root)
        client.close()
        store.terminate()
        store.wait(30)
        lines += _time_rebuild(root)
        if args.rebuild_files:
            shutil.rmtree(root)
            _write_small_files(root, args.rebuild_files)
            lines += _time_rebuild(root)
    finally:
        store.kill()
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"disk tier at {args.folder}: blocks of {_FP.block_bytes / 2**10:.0f} KiB, "
        f"batches of {_BATCH}"
    )
    for line in lines:
        print("  " + line)


if __name__ == "__main__":
    main()
