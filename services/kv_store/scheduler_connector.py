"""The store connector's engine-core half (KvStoreConnector, SharedStorageConnector,
OffloadingConnector): external hits, what each step loads and saves, and the figures.

- a consumer (kv_consumer, kv_both) loads the full prompt blocks the store holds past its
  local prefix hits, before the request computes;
- a producer (kv_producer, kv_both) saves every full block it computes, once;
- the offloading connector is a CPU tier: it saves the prefix blocks the engine's cache
  evicts (before the step rewrites them) and loads them back like external hits.

With KV cache groups, every step walks each group's blocks under its own keys (which blocks
of which group: group_blocks.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvserve.services.kv_store.backends import GuardedBackend, make_backend
from kvserve.services.kv_store.connector import SchedulerConnector
from kvserve.services.kv_store.group_blocks import GroupBlocks, Range
from kvserve.services.kv_store.transfers import (
    KVBlockTransfer,
    StoreConnectorMeta,
    decode_meta,
    decode_output,
    encode,
)
from kvserve.shared.config import KVTransferConfig
from kvserve.shared.kv_cache_groups import KVCacheGroupSpec
from kvserve.shared.logging import init_logger
from kvserve.shared.messages import KvFingerprint, KvStoreStats

if TYPE_CHECKING:
    from kvserve.services.scheduler.core.kv_cache_manager import KVCacheManager
    from kvserve.services.scheduler.core.request import Request
    from kvserve.services.scheduler.core.step_plan import StepPlan

logger = init_logger(__name__)


class StoreSchedulerConnector(SchedulerConnector):
    """
    Args:
        config: --kv-transfer-config.
        fingerprint: the layout of TP rank 0's blocks (what a lookup asks for).
        block_size: tokens per block.
    """

    def __init__(self, config: KVTransferConfig, fingerprint: KvFingerprint, block_size: int):
        self.config = config
        self.block_size = block_size
        self.store = GuardedBackend(make_backend(config, fingerprint), "scheduler")
        offloading = config.kv_connector == "OffloadingConnector"
        self.loads_external = config.is_consumer or offloading
        self.saves_computed = config.is_producer and not offloading
        self.saves_evicted = offloading
        # One table until bind() tells the KV cache manager's groups.
        self.group_blocks = GroupBlocks([KVCacheGroupSpec(layer_indices=[])], [b""], block_size)
        self._loads: list[KVBlockTransfer] = []  # listed in the next metadata
        # req id -> (local blocks, each group's blocks asked), until answered
        self._loading: dict[str, tuple[int, list[Range]]] = {}
        self._num_saved: dict[str, int] = {}  # req id -> full blocks already saved
        # Prompt pins to write through: listed in the next metadata, pinned in the store
        # once that step's saves are done (by transfer id: hashes and TTL).
        self._pin_saves: list[KVBlockTransfer] = []
        self._pins_after_save: dict[str, float] = {}
        self._num_pins = 0
        self._stats = _StoreStats()
        # The store's own figures, refreshed at most once a second for the stats.
        self._store_stats: KvStoreStats | None = None
        self._stats_at = 0.0

    def bind(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind(kv_cache_manager)
        self.group_blocks = GroupBlocks(
            kv_cache_manager.groups, kv_cache_manager.hash_suffixes, self.block_size
        )
        if self.saves_evicted:
            kv_cache_manager.block_pool.evicted = []

    # ------------------------------------------------------------------ loads

    def num_external_blocks(self, request: Request, num_local_blocks: int) -> int:
        if not self.loads_external:
            return 0
        self._stats.queries += request.num_tokens
        # The last token is always recomputed, so its block never hits.
        block_hashes = request.block_hashes[: (request.num_tokens - 1) // self.block_size]
        if len(block_hashes) <= num_local_blocks:
            return 0
        # From the first block the engine lacks: each hash names its whole prefix, and the
        # offload tier holds only the blocks the engine evicted (a chain's tail first).
        end = self.group_blocks.hit_end(
            block_hashes, num_local_blocks, lambda keys: self.store.call(0, "lookup", keys)
        )
        return end - num_local_blocks

    def start_load(self, request: Request, first_block: int, num_blocks: int) -> None:
        ranges = self.group_blocks.load_ranges(first_block, first_block + num_blocks)
        group_block_ids = self.kv_cache_manager.get_group_block_ids(request.req_id)
        load = self.group_blocks.transfer(
            request.req_id, request.block_hashes, group_block_ids, ranges
        )
        assert load is not None, f"{request} loads no block"
        self._loads.append(load)
        self._loading[request.req_id] = (first_block, ranges)

    def update_from_output(self, metadata: bytes, output: bytes) -> dict[str, int]:
        answer = decode_output(output)
        self._stats.add(answer)
        self._pin_saved(metadata)
        # Every listed load is answered; a missing answer means nothing loaded.
        loaded = {t.req_id: 0 for t in decode_meta(metadata).loads}
        loaded.update(answer.loaded)
        done = {}
        for req_id, num_loaded in loaded.items():
            asked = self._loading.pop(req_id, None)
            if asked is None:
                continue  # aborted while loading
            num_local, ranges = asked
            num_asked = ranges[0][1] - num_local
            done[req_id] = self.group_blocks.loaded_end(num_local, ranges, num_loaded) - num_local
            if done[req_id] < num_asked:
                logger.warning(
                    "request %s: %d of %d external blocks loaded; recomputing the rest",
                    req_id,
                    done[req_id],
                    num_asked,
                )
            self._stats.hits += done[req_id] * self.block_size
        return done

    # ------------------------------------------------------------------ saves

    def build_connector_meta(self, plan: StepPlan) -> bytes:
        meta = StoreConnectorMeta(loads=self._loads)
        self._loads = []
        pool = self.kv_cache_manager.block_pool
        # Pinned blocks stay held until their pin ends, so they are still whole here.
        meta.saves_before.extend(self._pin_saves)
        self._pin_saves = []
        if pool.evicted:
            meta.saves_before.append(
                KVBlockTransfer("", [h for h, _ in pool.evicted], [i for _, i in pool.evicted])
            )
            pool.evicted.clear()
        if self.saves_computed:
            for request in plan.scheduled_new:
                # Local hits and loaded blocks are in the store already.
                first = request.num_computed_tokens // self.block_size
                self._num_saved[request.req_id] = max(self._num_saved.get(request.req_id, 0), first)
            for request in (*plan.scheduled_running, *plan.scheduled_new):
                self._plan_save(request, plan.num_scheduled_tokens[request.req_id], meta)
        if not (meta.saves_before or meta.loads or meta.saves):
            return b""
        return encode(meta)

    def _plan_save(self, request: Request, num_scheduled: int, meta: StoreConnectorMeta) -> None:
        """The full blocks this step completes that were not saved yet (after the forward)."""
        num_full = min(
            (request.num_computed_tokens + num_scheduled) // self.block_size,
            len(request.block_hashes),
        )
        first = self._num_saved.get(request.req_id, 0)
        if num_full <= first:
            return
        save = self.group_blocks.transfer(
            request.req_id,
            request.block_hashes,
            self.kv_cache_manager.get_group_block_ids(request.req_id),
            self.group_blocks.save_ranges(first, num_full),
        )
        if save is not None:
            meta.saves.append(save)
        self._num_saved[request.req_id] = num_full

    def pin_blocks(
        self, block_hashes: list[bytes], block_ids: list[int], ttl_s: float, save: bool
    ) -> None:
        if not hasattr(self.store.backend, "pin"):
            return  # a shared-storage folder keeps every block anyway
        if not save:
            self.store.call(None, "pin", block_hashes, ttl_s)
            return
        self._num_pins += 1
        transfer_id = f"pin-{self._num_pins}"
        self._pin_saves.append(KVBlockTransfer(transfer_id, list(block_hashes), list(block_ids)))
        self._pins_after_save[transfer_id] = ttl_s

    def _pin_saved(self, metadata: bytes) -> None:
        """Pin in the store the prompt pins whose blocks this step wrote through."""
        if not self._pins_after_save or not metadata:
            return
        for transfer in decode_meta(metadata).saves_before:
            ttl_s = self._pins_after_save.pop(transfer.req_id, None)
            if ttl_s is not None:
                self.store.call(None, "pin", transfer.block_hashes, ttl_s)

    def request_finished(self, request: Request) -> None:
        self._loading.pop(request.req_id, None)
        self._num_saved.pop(request.req_id, None)

    # ------------------------------------------------------------------ stats

    @property
    def store_up(self) -> bool:
        return self.store.up

    def store_stats(self) -> KvStoreStats | None:
        now = time.monotonic()
        if now - self._stats_at >= 1.0:
            self._stats_at = now
            self._store_stats = self.store.call(None, "stats")
        return self._store_stats

    def take_stats(self) -> dict:
        fields = self._stats.take()
        fields["kv_store_up"] = self.store_up and fields["kv_store_up"]
        store = self.store_stats()
        if store is not None:
            fields["kv_store_usage"] = store.used_bytes / max(store.capacity_bytes, 1)
            fields["kv_store_hits"] = store.hits
            fields["kv_store_misses"] = store.misses
            fields |= _disk_fields(store)
        return fields

    def close(self) -> None:
        self.store.backend.close()


def _disk_fields(store: KvStoreStats) -> dict[str, int]:
    """The store's disk-tier figures under their SchedulerStats names (all 0 without one)."""
    return {
        "kv_store_disk_bytes": store.disk_bytes,
        "kv_store_disk_blocks": store.disk_blocks,
        "kv_store_disk_writes": store.disk_writes,
        "kv_store_disk_reads": store.disk_hits,
        "kv_store_disk_evictions": store.disk_evictions,
        "kv_store_disk_checksum_failures": store.disk_checksum_failures,
    }


class _StoreStats:
    """The connector's figures since the last SchedulerStats."""

    def __init__(self) -> None:
        self.queries = 0
        self.hits = 0
        self.store_ok = True
        self.seconds: list[float] = []
        self.bytes_loaded = 0
        self.bytes_saved = 0

    def add(self, answer) -> None:
        self.store_ok = answer.store_ok
        self.seconds.extend(answer.seconds)
        self.bytes_loaded += answer.bytes_loaded
        self.bytes_saved += answer.bytes_saved

    def take(self) -> dict:
        fields = {
            "external_prefix_cache_queries": self.queries,
            "external_prefix_cache_hits": self.hits,
            "kv_store_up": self.store_ok,
            "kv_transfer_seconds": self.seconds,
            "kv_bytes_loaded": self.bytes_loaded,
            "kv_bytes_saved": self.bytes_saved,
        }
        self.queries = self.hits = self.bytes_loaded = self.bytes_saved = 0
        self.seconds = []
        return fields
