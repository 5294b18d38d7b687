"""KV connectors by name: what `KVTransferConfig.kv_connector` selects.

A new connector registers its two halves once (at import of its module), and the engine core
and the workers build them from the config; nothing in the core names a connector.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.services.kv_store.connector import SchedulerConnector, WorkerConnector
from kvserve.services.kv_store.scheduler_connector import StoreSchedulerConnector
from kvserve.services.kv_store.worker_connector import StoreWorkerConnector
from kvserve.shared.config import KVTransferConfig
from kvserve.shared.messages import KvFingerprint

# What a registered class is called with: (config, TP rank 0's fingerprint, block size) for
# the scheduler half, (config, this rank's fingerprint, its KV caches) for the worker half.
SchedulerFactory = Callable[[KVTransferConfig, KvFingerprint, int], SchedulerConnector]
WorkerFactory = Callable[[KVTransferConfig, KvFingerprint, list[torch.Tensor]], WorkerConnector]

_CONNECTORS: dict[str, tuple[SchedulerFactory, WorkerFactory]] = {
    name: (StoreSchedulerConnector, StoreWorkerConnector)
    for name in ("KvStoreConnector", "SharedStorageConnector", "OffloadingConnector")
}
# Connectors that move each KV cache group's blocks (group_blocks.py); with any other, the
# worker keeps one group of every layer (services/worker/kv_cache_groups.py).
_WALKS_KV_CACHE_GROUPS = set(_CONNECTORS)


def register_kv_connector(
    name: str,
    scheduler_cls: SchedulerFactory,
    worker_cls: WorkerFactory,
    walks_kv_cache_groups: bool = False,
) -> None:
    """Make `name` a kv_connector choice.

    Args:
        name: the KVTransferConfig.kv_connector value that selects it.
        scheduler_cls: built as scheduler_cls(config, fingerprint, block_size).
        worker_cls: built as worker_cls(config, fingerprint, kv_caches) on every rank.
        walks_kv_cache_groups: it moves each group's blocks under its own keys (the KV
            cache manager's `groups`, `hash_suffixes`, `get_group_block_ids`), so a model
            with several kinds of attention layer keeps its groups beside it.
    """
    _CONNECTORS[name] = (scheduler_cls, worker_cls)
    if walks_kv_cache_groups:
        _WALKS_KV_CACHE_GROUPS.add(name)
    else:
        _WALKS_KV_CACHE_GROUPS.discard(name)


def walks_kv_cache_groups(name: str) -> bool:
    """Whether connector `name` moves each KV cache group's blocks."""
    return name in _WALKS_KV_CACHE_GROUPS


def _lookup(name: str) -> tuple[SchedulerFactory, WorkerFactory]:
    try:
        return _CONNECTORS[name]
    except KeyError:
        raise ValueError(
            f"unknown kv_connector {name!r}; registered: {sorted(_CONNECTORS)}"
        ) from None


def make_scheduler_connector(
    config: KVTransferConfig, fingerprint: KvFingerprint, block_size: int
) -> SchedulerConnector:
    """The engine core's half of the configured connector."""
    return _lookup(config.kv_connector)[0](config, fingerprint, block_size)


def make_worker_connector(
    config: KVTransferConfig, fingerprint: KvFingerprint, kv_caches: list[torch.Tensor]
) -> WorkerConnector:
    """A worker rank's half of the configured connector."""
    return _lookup(config.kv_connector)[1](config, fingerprint, kv_caches)
