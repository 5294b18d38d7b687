"""The store connector's worker half: each rank moves its own blocks.

Before the forward it copies out the evicted blocks (the step rewrites their slots) and
copies in the loads; after it, it saves the blocks the step computed. Under TP every rank
moves its own shard, under its own fingerprint (tp_rank), and the ranks agree on the
smallest count any of them loaded.
"""

from __future__ import annotations

import time

import torch

from kvserve.services.kv_store.backends import GuardedBackend, make_backend
from kvserve.services.kv_store.connector import WorkerConnector
from kvserve.services.kv_store.transfers import (
    KVBlockTransfer,
    StoreConnectorOutput,
    decode_meta,
    encode,
)
from kvserve.services.worker.parallel_state import get_tp_group, get_tp_size
from kvserve.shared.config import KVTransferConfig
from kvserve.shared.messages import KvFingerprint


class StoreWorkerConnector(WorkerConnector):
    """
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
        self.store = GuardedBackend(
            make_backend(config, fingerprint), f"rank {fingerprint.tp_rank}"
        )
        self.seconds: list[float] = []
        self.bytes_loaded = 0
        self.bytes_saved = 0
        self._loaded: dict[str, int] = {}

    def before_forward(self, metadata: bytes) -> None:
        meta = decode_meta(metadata)
        if meta.saves_before:
            self.save(meta.saves_before)
        self._loaded = self._agree(meta.loads, self.load(meta.loads)) if meta.loads else {}

    def after_forward(self, metadata: bytes) -> bytes:
        meta = decode_meta(metadata)
        if meta.saves:
            self.save(meta.saves)
        seconds, bytes_loaded, bytes_saved = self.take_stats()
        answer = StoreConnectorOutput(
            loaded=self._loaded,
            store_ok=self.store_up,
            seconds=seconds,
            bytes_loaded=bytes_loaded,
            bytes_saved=bytes_saved,
        )
        self._loaded = {}
        return encode(answer)

    @staticmethod
    def _agree(loads: list[KVBlockTransfer], loaded: dict[str, int]) -> dict[str, int]:
        """Every TP rank keeps the smallest count any rank loaded."""
        if get_tp_size() <= 1:
            return loaded
        counts = torch.tensor([loaded[t.req_id] for t in loads], dtype=torch.int64)
        torch.distributed.all_reduce(
            counts, op=torch.distributed.ReduceOp.MIN, group=get_tp_group()
        )
        return {t.req_id: int(n) for t, n in zip(loads, counts)}

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

    def close(self) -> None:
        self.store.backend.close()
