"""KV cache events for external routers: vLLM's wire format (vllm/distributed/kv_events.py).

A KV-aware router (llm-d's precise prefix scheduler, Dynamo) subscribes to each engine and
keeps a map of which block hashes it holds. One message per engine step that changed the
prefix cache, on a ZMQ PUB socket, as three frames:

    [topic, seq (8 bytes, big-endian), msgpack(KVEventBatch)]

    KVEventBatch = [ts, [event, ...], data_parallel_rank]              (an array)
    event        = {"type": "BlockStored", "block_hashes": [...], ...}  (a tagged map)

A replay ROUTER answers [b"", seq (8 bytes)] with every buffered message from `seq` on,
each as [b"", topic, seq, payload], then [b"", b"", END_SEQ, b""].

The structs keep vLLM 0.32's field names, order and options, so vLLM's own decoder reads
kvserve's messages and the other way round. Block hashes are kvserve's (bytes, see
shared/hashing.py), medium is always "GPU" (the engine's own cache, CPU or GPU alike). With
KV cache groups, each event also names its group as vLLM's hybrid manager does
(`group_idx`, `kv_cache_spec_kind`, `kv_cache_spec_sliding_window`: trailing fields with
defaults, so they are left out without groups and older decoders skip them).
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One change to an engine's prefix cache (the tag is the class name)."""


class BlockStored(KVCacheEvent):
    """Full blocks entered the prefix cache, a chain under one parent.

    Args:
        block_hashes: the blocks' hashes, in prompt order.
        parent_block_hash: the hash of the block before the first one (None: it starts
            the prompt).
        token_ids: the blocks' tokens, block_size per block.
        block_size: tokens per block.
        lora_id: the adapter's int id (None: the base model); deprecated in vLLM.
        medium: where the blocks are ("GPU").
        lora_name: the adapter's name (None: the base model).
        group_idx: the KV cache group whose blocks these are (None: one table for every
            layer); the hashes are the request's, whatever the group.
        kv_cache_spec_kind: the group's kind ("full_attention", "sliding_window",
            "chunked_local_attention"; None without groups).
        kv_cache_spec_sliding_window: a sliding group's window in tokens (else None).
    """

    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks left the prefix cache (evicted for reuse); group_idx as BlockStored's."""

    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was dropped (reset_prefix_cache)."""


# The events a KVEventBatch carries.
KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVEventBatch(EventBatch):
    """The events of one engine step, stamped with wall time and the engine's DP rank."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _decoder.decode(payload)


_GROUP_FIELDS = ("group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")


def event_to_json(seq: int, batch: KVEventBatch, event: KVCacheEvent) -> dict[str, Any]:
    """One event as a flat JSON-able dict (hashes as hex): what `kvserve kv-events` prints."""
    fields = msgspec.structs.asdict(event)
    for name in _GROUP_FIELDS:  # only with KV cache groups, as on the wire
        if fields.get(name, 0) is None:
            del fields[name]
    for name in ("block_hashes",):
        if name in fields:
            fields[name] = [_hash_text(h) for h in fields[name]]
    if "parent_block_hash" in fields:
        parent = fields["parent_block_hash"]
        fields["parent_block_hash"] = None if parent is None else _hash_text(parent)
    return {
        "seq": seq,
        "ts": batch.ts,
        "dp_rank": batch.data_parallel_rank,
        "type": type(event).__name__,
        **fields,
    }


def _hash_text(block_hash: bytes | int) -> str | int:
    return block_hash.hex() if isinstance(block_hash, bytes) else block_hash
