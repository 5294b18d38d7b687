"""What the store connector's two halves say to each other, inside the core's opaque bytes
(SchedulerOutput.kv_connector_metadata and ModelRunnerOutput.kv_connector_output)."""

from __future__ import annotations

import msgspec

_WIRE = dict(array_like=True, omit_defaults=True, gc=False)


class KVBlockTransfer(msgspec.Struct, **_WIRE):
    """Blocks one request moves between its paged KV cache and the store: block_ids[i]
    holds (or will hold) the block of hash block_hashes[i]."""

    req_id: str
    block_hashes: list[bytes]
    block_ids: list[int]


class StoreConnectorMeta(msgspec.Struct, **_WIRE):
    """One step's transfers: blocks to copy out before the forward (prefix blocks this
    step's allocation evicts: the offload tier), to load before it (external prefix hits of
    requests waiting for them), and to save after it (full blocks the step computes)."""

    saves_before: list[KVBlockTransfer] = []
    loads: list[KVBlockTransfer] = []
    saves: list[KVBlockTransfer] = []


class StoreConnectorOutput(msgspec.Struct, **_WIRE):
    """Rank 0's answer: blocks loaded per load (fewer than asked: the rest is recomputed),
    whether the store answered, and the transfers' figures."""

    loaded: dict[str, int] = {}
    store_ok: bool = True
    seconds: list[float] = []
    bytes_loaded: int = 0
    bytes_saved: int = 0


_meta_decoder = msgspec.msgpack.Decoder(StoreConnectorMeta)
_output_decoder = msgspec.msgpack.Decoder(StoreConnectorOutput)


def encode(message: StoreConnectorMeta | StoreConnectorOutput) -> bytes:
    return msgspec.msgpack.encode(message)


def decode_meta(data: bytes) -> StoreConnectorMeta:
    return _meta_decoder.decode(data) if data else StoreConnectorMeta()


def decode_output(data: bytes) -> StoreConnectorOutput:
    return _output_decoder.decode(data) if data else StoreConnectorOutput()
