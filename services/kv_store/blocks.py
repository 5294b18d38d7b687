"""Copies between a paged KV cache and store slots, many blocks per torch op.

The paged cache is one tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_size]
(services/worker/model_runner.py); a store slot is [num_layers, 2, block_elements]
(services/kv_store/arena.py). Seen as `slots_view` [num_slots, num_layers, 2, E], a run of
consecutive slots is one strided tensor, so each layer of a run is a single op (a latent
cache, MLA's, has one plane where K and V have two: `KvFingerprint.num_planes`):

    put:  index_select(cache[layer], dim=1, block_ids[run], out=slots_view[run, layer]^T)
    get:  cache[layer].index_copy_(dim=1, block_ids[run], slots_view[run, layer]^T)

That writes each byte once. Scattered slots would need a gathered copy first (two passes),
so the store hands out the lowest free slots, which keeps a batch in few runs; a batch that
still comes in many short runs takes the two-pass path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.services.kv_store.arena import slot_runs
from kvserve.shared.messages import KvFingerprint

# A batch in more runs than this (and than 1/8 of its blocks) is copied in two passes.
_MAX_RUNS = 4


def slots_view(buffer: object, fingerprint: KvFingerprint, dtype: torch.dtype) -> torch.Tensor:
    """A host arena (or any buffer of whole slots) as [num_slots, num_layers, planes, E]."""
    flat = torch.frombuffer(buffer, dtype=dtype)
    fp = fingerprint
    return flat.view(-1, fp.num_layers, fp.num_planes, fp.block_elements)


def check_kv_caches(kv_caches: Sequence[torch.Tensor], fingerprint: KvFingerprint) -> None:
    """ValueError unless the caches have the fingerprint's layout."""
    fp = fingerprint
    if len(kv_caches) != fp.num_layers:
        raise ValueError(f"{len(kv_caches)} KV-cache tensors for a {fp.num_layers}-layer layout")
    expected = (fp.block_size, fp.num_kv_heads, fp.head_size)
    for cache in kv_caches:
        planes = fp.num_planes
        if cache.dim() != 5 or cache.shape[0] != planes or tuple(cache.shape[2:]) != expected:
            raise ValueError(
                f"a KV-cache tensor of shape {tuple(cache.shape)}; the store's layout needs "
                f"[{planes}, num_blocks, {fp.block_size}, {fp.num_kv_heads}, {fp.head_size}]"
            )
        if str(cache.dtype).removeprefix("torch.") != fp.dtype or not cache.is_contiguous():
            raise ValueError(f"KV-cache tensors must be contiguous {fp.dtype}, not {cache.dtype}")


# Copied as bytes: torch has no index_copy_ for the fp8 caches of --kv-cache-dtype.
_BYTE_COPIED = (torch.float8_e4m3fn, torch.float8_e5m2)


def _as_copied(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in _BYTE_COPIED else t


def _flat(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(cache.shape[0], cache.shape[1], -1)  # [planes, num_blocks, E]


def _ids(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(block_ids, dtype=torch.long).to(device, non_blocking=True)


def _few_runs(runs: list, num_blocks: int) -> bool:
    return len(runs) <= max(_MAX_RUNS, num_blocks // 8)


def copy_blocks_to_slots(
    kv_caches: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    view: torch.Tensor,
    slots: Sequence[int],
) -> None:
    """view[slots[i]] = every layer's K and V of block block_ids[i]."""
    if not slots:
        return
    view, kv_caches = _as_copied(view), [_as_copied(cache) for cache in kv_caches]
    device = kv_caches[0].device
    ids = _ids(block_ids, device)
    runs = slot_runs(slots)
    if not _few_runs(runs, len(slots)):
        slot_ids = _ids(slots, view.device)
        for layer, cache in enumerate(kv_caches):
            gathered = _flat(cache).index_select(1, ids).to(view.device)
            view[:, layer].index_copy_(0, slot_ids, gathered.transpose(0, 1))
        return
    for start, first_slot, length in runs:
        run = view[first_slot : first_slot + length]
        run_ids = ids[start : start + length]
        for layer, cache in enumerate(kv_caches):
            dst = run[:, layer].transpose(0, 1)  # [2, length, E], strided
            if dst.device == device:
                torch.index_select(_flat(cache), 1, run_ids, out=dst)
            else:
                dst.copy_(_flat(cache).index_select(1, run_ids))


def copy_slots_to_blocks(
    view: torch.Tensor,
    slots: Sequence[int],
    kv_caches: Sequence[torch.Tensor],
    block_ids: Sequence[int],
) -> None:
    """Block block_ids[i] of every layer = view[slots[i]]."""
    if not slots:
        return
    view, kv_caches = _as_copied(view), [_as_copied(cache) for cache in kv_caches]
    device = kv_caches[0].device
    ids = _ids(block_ids, device)
    runs = slot_runs(slots)
    if not _few_runs(runs, len(slots)):
        slot_ids = _ids(slots, view.device)
        for layer, cache in enumerate(kv_caches):
            gathered = view[:, layer].index_select(0, slot_ids).to(device)
            _flat(cache).index_copy_(1, ids, gathered.transpose(0, 1))
        return
    for start, first_slot, length in runs:
        run = view[first_slot : first_slot + length].to(device)
        run_ids = ids[start : start + length]
        for layer, cache in enumerate(kv_caches):
            _flat(cache).index_copy_(1, run_ids, run[:, layer].transpose(0, 1))
