"""Where a KV connector keeps blocks: the `kvserve kv-store` service or a folder of files.

`KvStoreClient` (client.py: shared memory on one host, frames over tcp) and
`SharedStorageBackend` (one file per block in a folder; the simple one to debug with). A
`GuardedBackend` turns a store that does not answer into a fallback value (a lookup finds 0,
a load loads nothing, so requests recompute) and retries it at most once a second.
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
from kvserve.shared.messages import KvFingerprint, KvStoreStats

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


class GuardedBackend:
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
