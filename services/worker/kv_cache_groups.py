"""The worker's side of KV cache groups (shared/kv_cache_groups.py): which groups this model
gets, the cache tensors they share, and each group's block table and slot mapping per step.

With one group nothing here runs on the step path: the runner keeps its single block table
(InputBatch.block_table, AttentionMetadata.block_table). With G > 1, InputBatch keeps G - 1
more tables (`group_block_tables`), `prepare_group_tables` builds their rows and slots each
step, and every attention layer reads its own group's (`Attention.kv_cache_group`).
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.services.worker.layers.attention import Attention
from kvserve.shared.config import EngineConfig
from kvserve.shared.kv_cache_groups import (
    KVCacheGroupSpec,
    group_size_of,
    make_kv_cache_groups,
)
from kvserve.shared.logging import init_logger

logger = init_logger(__name__)


def plan_kv_cache_groups(
    config: EngineConfig, layers: list[Attention], single_stage: bool
) -> list[KVCacheGroupSpec]:
    """The model's groups, or one group of every layer (every block kept, windows masked, as
    before groups existed) where a part that moves blocks by one table runs beside them."""
    kinds = [(layer.sliding_window or 0, layer.attention_chunk_size or 0) for layer in layers]
    groups = make_kv_cache_groups(kinds)
    if all(group.is_full for group in groups):
        return groups
    reason = _one_table_reason(config, layers, single_stage)
    if reason is not None:
        logger.info(
            "KV cache groups off (%s): every layer keeps every block; windows only mask",
            reason,
        )
        return [KVCacheGroupSpec(layer_indices=list(range(len(layers))))]
    logger.info(
        "KV cache groups: %d of %d layers each: %s",
        len(groups),
        group_size_of(groups),
        ", ".join(_describe(group) for group in groups),
    )
    return groups


def _one_table_reason(
    config: EngineConfig, layers: list[Attention], single_stage: bool
) -> str | None:
    if config.speculative_config is not None:
        return "--speculative-config: the proposer's cache follows one block table"
    transfer = config.kv_transfer_config
    if transfer is not None:
        from kvserve.services.kv_store.registry import walks_kv_cache_groups

        if not walks_kv_cache_groups(transfer.kv_connector):
            return f"the KV connector {transfer.kv_connector} moves one table's blocks"
    if not single_stage:
        return "pipeline parallel: the scheduler needs every stage's layers in one grouping"
    if len({layer.kv_cache_spec() for layer in layers}) > 1:
        return "the layers' cache layouts differ"
    if any(type(layer).forward is not Attention.forward for layer in layers):
        return "an attention layer with its own forward"
    return None


def _describe(group: KVCacheGroupSpec) -> str:
    kind = "full"
    if group.sliding_window:
        kind = f"window {group.sliding_window}"
    if group.chunk_size:
        kind = f"chunk {group.chunk_size}"
    return f"{kind} {group.layer_indices}"


def bind_grouped_kv_caches(
    layers: list[Attention],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    groups: list[KVCacheGroupSpec],
) -> list[torch.Tensor]:
    """Allocate the groups' shared cache tensors (group_size of them) and bind tensor j to
    the j-th layer of every group; returns the tensors."""
    spec = layers[0].kv_cache_spec()
    caches = [
        spec.allocate(num_blocks, block_size, dtype, device) for _ in range(group_size_of(groups))
    ]
    for group_index, group in enumerate(groups):
        for tensor_index, layer_index in enumerate(group.layer_indices):
            layers[layer_index].kv_cache = caches[tensor_index]
            layers[layer_index].kv_cache_group = group_index
    return caches


def group_kv_cache_bytes_per_block(
    layers: list[Attention], groups: list[KVCacheGroupSpec], block_size: int, dtype: torch.dtype
) -> int:
    """Bytes of one block: a page of each shared tensor (one group's worth of layers)."""
    return group_size_of(groups) * layers[0].kv_cache_spec().block_bytes(block_size, dtype)


def prepare_group_tables(
    group_block_tables: list[np.ndarray],
    rows: np.ndarray,
    token_rows: np.ndarray,
    positions: np.ndarray,
    num_blocks_needed: int,
    block_size: int,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(block_table, slot_mapping) of groups 1.. for this step's rows and tokens, as
    step_inputs.prepare_inputs builds group 0's."""
    tables = []
    for table in group_block_tables:
        slot_mapping = (
            table[token_rows, positions // block_size].astype(np.int64) * block_size
            + positions % block_size
        )
        block_table = np.ascontiguousarray(table[rows, :num_blocks_needed])
        tables.append(
            (torch.from_numpy(block_table).to(device), torch.from_numpy(slot_mapping).to(device))
        )
    return tables
