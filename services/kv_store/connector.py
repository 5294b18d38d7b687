"""The KV connector: how an engine's paged cache meets a store (vLLM's KV-connector shape).

Two halves, one per process kind:

- `SchedulerConnector` (engine core): how many of a waiting request's full prompt blocks,
  past its local prefix hits, the store holds (external hits); which blocks a step saves
  (kv_producer / kv_both: every full block it computes, once); which evicted prefix blocks
  go to the store first (OffloadingConnector, the CPU tier). The scheduler turns these into
  `SchedulerOutput.kv_loads / kv_saves / kv_saves_before`.
- `WorkerConnector` (each worker rank): copies out the evicted blocks and copies in the
  loads before the forward, saves after it, and reports what it loaded
  (`ModelRunnerOutput.kv_loaded`). Under TP every rank moves its own shard, under its own
  fingerprint (tp_rank), and the ranks agree on the smallest count loaded.

Backends: `KvStoreClient` (the `kvserve kv-store` service: shared memory on one host,
frames over tcp) and `SharedStorageBackend` (one file per block in a folder; the simple one
to debug with). A store that does not answer makes lookups return 0 and loads load nothing,
so requests recompute; the connector retries the store at most once a second.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Protocol

import torch

from kvserve.services.kv_store.client import KvStoreClient, KvStoreUnavailable
from kvserve.shared.config import KVTransferConfig
from kvserve.shared.logging import init_logger
from kvserve.shared.messages import KVBlockTransfer, KvFingerprint, KvStoreStats

logger = init_logger(__name__)

# After the store fails to answer, skip it this long before trying again.
_RETRY_AFTER_S = 1.0


class KVBackend(Protocol):
    def lookup(self, block_hashes: Sequence[bytes]) -> int: ...

    def put(
        self, block_hashes: Sequence[bytes], kv_caches: Sequence[torch.Tensor], block_ids
    ) -> int: ...

    def get(
        self, block_hashes: Sequence[bytes], kv_caches: Sequence[torch.Tensor], block_ids
    ) -> int: ...

    def stats(self) -> KvStoreStats | None: ...

    def close(self) -> None: ...


class SharedStorageBackend:
    """Blocks as files: FOLDER/<layout key>/<block hash>.kv, each the block's K and V of
    every layer ([layers, 2, block_size, heads, head_size], raw bytes). Written to a temp
    name and renamed, so a reader never sees half a block."""

    def __init__(self, folder: str, fingerprint: KvFingerprint):
        self.folder = os.path.join(folder, fingerprint.key().hex())
        os.makedirs(self.folder, exist_ok=True)
        self.fingerprint = fingerprint
        self.dtype = getattr(torch, fingerprint.dtype)

    def _path(self, block_hash: bytes) -> str:
        return os.path.join(self.folder, block_hash.hex() + ".kv")

    def lookup(self, block_hashes: Sequence[bytes]) -> int:
        for i, block_hash in enumerate(block_hashes):
            if not os.path.exists(self._path(block_hash)):
                return i
        return len(block_hashes)

    def put(self, block_hashes, kv_caches, block_ids) -> int:
        for block_hash, block_id in zip(block_hashes, block_ids):
            path = self._path(block_hash)
            if os.path.exists(path):
                continue
            block = torch.stack([cache[:, block_id] for cache in kv_caches])
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(block.contiguous().view(torch.uint8).numpy().tobytes())
            os.replace(tmp, path)
        return len(block_hashes)

    def get(self, block_hashes, kv_caches, block_ids) -> int:
        shape = (len(kv_caches), *kv_caches[0][:, 0].shape)
        for i, (block_hash, block_id) in enumerate(zip(block_hashes, block_ids)):
            try:
                with open(self._path(block_hash), "rb") as f:
                    data = bytearray(f.read())
            except FileNotFoundError:
                return i
            block = torch.frombuffer(data, dtype=torch.uint8).view(self.dtype).view(shape)
            for layer, cache in enumerate(kv_caches):
                cache[:, block_id].copy_(block[layer])
        return len(block_hashes)

    def stats(self) -> KvStoreStats | None:
        return None

    def close(self) -> None:
        pass


def make_backend(config: KVTransferConfig, fingerprint: KvFingerprint) -> KVBackend:
    extra = config.kv_connector_extra_config
    if config.kv_connector == "SharedStorageConnector":
        return SharedStorageBackend(str(extra["shared_storage_path"]), fingerprint)
    timeout_s = float(extra.get("timeout_s", 2.0))
    return KvStoreClient(str(extra["store_address"]), fingerprint, timeout_s, connect=False)


class _Guarded:
    """A backend whose failures turn into a fallback value and a pause before the next try."""

    def __init__(self, backend: KVBackend, who: str):
        self.backend = backend
        self.who = who
        self.up = True
        self._down_until = 0.0

    def call(self, fallback, method: str, *args):
        if not self.up and time.monotonic() < self._down_until:
            return fallback
        try:
            result = getattr(self.backend, method)(*args)
        except (KvStoreUnavailable, OSError) as exc:
            if self.up:
                logger.warning("%s: the KV store is unavailable (%s); recomputing", self.who, exc)
            self.up = False
            self._down_until = time.monotonic() + _RETRY_AFTER_S
            return fallback
        if not self.up:
            logger.info("%s: the KV store answers again", self.who)
        self.up = True
        return result


class SchedulerConnector:
    """The engine core's half (see the module docstring).

    Args:
        config: --kv-transfer-config.
        fingerprint: the layout of TP rank 0's blocks (what a lookup asks for).
        block_size: tokens per block.
    """

    def __init__(self, config: KVTransferConfig, fingerprint: KvFingerprint, block_size: int):
        self.config = config
        self.block_size = block_size
        self.store = _Guarded(make_backend(config, fingerprint), "scheduler")
        self.loads_external = config.is_consumer or config.kv_connector == "OffloadingConnector"
        self.saves_computed = config.is_producer and config.kv_connector != "OffloadingConnector"
        self.saves_evicted = config.kv_connector == "OffloadingConnector"
        # The store's own figures, refreshed at most once a second for the stats.
        self._store_stats: KvStoreStats | None = None
        self._stats_at = 0.0

    def num_external_blocks(self, block_hashes: list[bytes], num_local_blocks: int) -> int:
        """Full blocks past the local hits that the store holds, from the first of them.

        Args:
            block_hashes: the request's hashes of the blocks that may hit (the last token is
                always recomputed, so its block is not among them).
            num_local_blocks: blocks the engine's own prefix cache already gives.
        """
        if not self.loads_external or len(block_hashes) <= num_local_blocks:
            return 0
        # From the first block the engine lacks: each hash names its whole prefix, and the
        # offload tier holds only the blocks the engine evicted (a chain's tail first).
        return self.store.call(0, "lookup", block_hashes[num_local_blocks:])

    @property
    def store_up(self) -> bool:
        return self.store.up

    def store_stats(self) -> KvStoreStats | None:
        now = time.monotonic()
        if now - self._stats_at >= 1.0:
            self._stats_at = now
            self._store_stats = self.store.call(None, "stats")
        return self._store_stats

    def close(self) -> None:
        self.store.backend.close()


class WorkerConnector:
    """A worker rank's half: moves its own blocks.

    Args:
        config: --kv-transfer-config.
        fingerprint: this rank's layout.
        kv_caches: the rank's paged caches, one [2, num_blocks, block_size, heads, head]
            tensor per layer.
    """

    def __init__(
        self, config: KVTransferConfig, fingerprint: KvFingerprint, kv_caches: list[torch.Tensor]
    ):
        self.kv_caches = kv_caches
        self.block_bytes = fingerprint.block_bytes
        self.store = _Guarded(make_backend(config, fingerprint), f"rank {fingerprint.tp_rank}")
        self.seconds: list[float] = []
        self.bytes_loaded = 0
        self.bytes_saved = 0

    def save(self, transfers: list[KVBlockTransfer]) -> None:
        """Copy the listed blocks into the store (what does not fit is simply not kept)."""
        for t in transfers:
            start = time.perf_counter()
            stored = self.store.call(0, "put", t.block_hashes, self.kv_caches, t.block_ids)
            self.seconds.append(time.perf_counter() - start)
            self.bytes_saved += stored * self.block_bytes

    def load(self, transfers: list[KVBlockTransfer]) -> dict[str, int]:
        """Copy each request's listed blocks in; how many, from the first, each got."""
        loaded = {}
        for t in transfers:
            start = time.perf_counter()
            num = self.store.call(0, "get", t.block_hashes, self.kv_caches, t.block_ids)
            self.seconds.append(time.perf_counter() - start)
            self.bytes_loaded += num * self.block_bytes
            loaded[t.req_id] = num
        return loaded

    def take_stats(self) -> tuple[list[float], int, int]:
        """(transfer seconds, bytes loaded, bytes saved) since the last call."""
        stats = (self.seconds, self.bytes_loaded, self.bytes_saved)
        self.seconds, self.bytes_loaded, self.bytes_saved = [], 0, 0
        return stats

    @property
    def store_up(self) -> bool:
        return self.store.up
