"""KV cache events: vLLM's wire layout, the block pool's events, and the publisher's
sequence numbers and replay on real ZMQ sockets."""

from __future__ import annotations

import time
from functools import partial

import msgspec
import pytest
import zmq

from kvserve.cli import main
from kvserve.services.scheduler.core.kv_cache_groups import GroupedKVCacheManager
from kvserve.services.scheduler.core.kv_cache_manager import KVCacheManager
from kvserve.services.scheduler.engine.kv_event_publisher import (
    KVEventPublisher,
    is_bind_endpoint,
    offset_endpoint,
)
from kvserve.shared import transport_security
from kvserve.shared.config import EngineConfig, KVEventsConfig
from kvserve.shared.env import INSECURE_TRANSPORT, TRANSPORT_KEYS
from kvserve.shared.kv_cache_groups import KVCacheGroupSpec
from kvserve.shared.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
)
from kvserve.shared.transport import make_socket
from kvserve.shared.transport_security import generate_keys
from tests.support.kv import assert_all_blocks_free
from tests.support.ports import free_port
from tests.support.scheduler import make_hashed_request

BLOCK_SIZE = 4
make_request = partial(make_hashed_request, block_size=BLOCK_SIZE)

# vLLM 0.32, vllm/distributed/kv_events.py: the required fields of each event, in order
# (fields with defaults are omitted when default: omit_defaults=True).
VLLM_BLOCK_STORED_FIELDS = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
]
VLLM_BLOCK_REMOVED_FIELDS = ["block_hashes", "medium"]


def test_batch_encodes_as_vllm_array_with_tagged_event_maps():
    stored = BlockStored(
        block_hashes=[b"\x01" * 4, 7],
        parent_block_hash=None,
        token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    removed = BlockRemoved(block_hashes=[b"\x02"], medium="GPU")
    batch = KVEventBatch(
        ts=12.5, events=[stored, removed, AllBlocksCleared()], data_parallel_rank=3
    )
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    # EventBatch is array_like: [ts, events, data_parallel_rank].
    assert raw[0] == 12.5 and raw[2] == 3 and len(raw) == 3
    stored_raw, removed_raw, cleared_raw = raw[1]
    assert list(stored_raw) == ["type", *VLLM_BLOCK_STORED_FIELDS]
    assert stored_raw["type"] == "BlockStored"
    assert stored_raw["block_hashes"] == [b"\x01" * 4, 7]
    assert stored_raw["token_ids"] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert list(removed_raw) == ["type", *VLLM_BLOCK_REMOVED_FIELDS]
    assert cleared_raw == {"type": "AllBlocksCleared"}
    assert decode_batch(msgspec.msgpack.encode(batch)) == batch


def test_batch_without_rank_sends_nil_as_vllm_does():
    # Checked byte for byte against vLLM 0.32's own structs: the subclass does not inherit
    # omit_defaults, so the rank slot is always there.
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=[])))
    assert raw == [1.0, [], None]


def make_manager(num_blocks: int) -> KVCacheManager:
    manager = KVCacheManager(num_blocks, BLOCK_SIZE, True, max_model_len=64)
    manager.enable_kv_events()
    return manager


def admit(manager: KVCacheManager, request) -> None:
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
    new_tokens = request.num_tokens - num_hit_tokens
    assert manager.allocate_slots(request, new_tokens, num_hit_tokens, hit_blocks) is not None
    request.num_computed_tokens = request.num_tokens


def test_full_blocks_of_a_prompt_are_stored_chained_to_their_parent():
    manager = make_manager(num_blocks=16)
    first = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    admit(manager, first)
    (stored,) = manager.take_events()
    assert stored == BlockStored(
        block_hashes=first.block_hashes[:2],
        parent_block_hash=None,
        token_ids=list(range(8)),
        block_size=BLOCK_SIZE,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    assert manager.take_events() == []
    # Same first block, then new ones: only the new blocks, under the shared block's hash.
    second = make_request("b", [0, 1, 2, 3, 40, 41, 42, 43, 44, 45, 46, 47, 48])
    admit(manager, second)
    (stored,) = manager.take_events()
    assert stored.block_hashes == second.block_hashes[1:3]
    assert stored.parent_block_hash == first.block_hashes[0]
    assert stored.token_ids == list(range(40, 48))


def test_evicted_blocks_are_removed_in_eviction_order():
    manager = make_manager(num_blocks=4)  # 3 usable blocks
    first = make_request("a", list(range(12)))  # 3 full blocks
    admit(manager, first)
    manager.take_events()
    manager.free(first)  # the tail goes first into the free queue
    other = make_request("b", [99, 98, 97, 96, 95])  # 2 blocks: evicts the 2 tail blocks
    admit(manager, other)
    events = manager.take_events()
    removed = [event for event in events if isinstance(event, BlockRemoved)]
    assert [event.block_hashes for event in removed] == [
        [first.block_hashes[2]],
        [first.block_hashes[1]],
    ]
    assert all(event.medium == "GPU" for event in removed)
    assert events[-1] == BlockStored(
        block_hashes=other.block_hashes[:1],
        parent_block_hash=None,
        token_ids=[99, 98, 97, 96],
        block_size=BLOCK_SIZE,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    manager.free(other)
    assert manager.reset_prefix_cache()
    assert manager.take_events() == [AllBlocksCleared()]


def test_with_kv_cache_groups_each_group_stores_and_removes_under_the_request_hashes():
    # vLLM's hybrid events: one BlockStored per group, naming it, with the request's hashes
    # (a group's key suffix stays inside the engine); a window's blocks leave as it moves.
    sliding = KVCacheGroupSpec(layer_indices=[0], sliding_window=4)
    full = KVCacheGroupSpec(layer_indices=[1])
    manager = GroupedKVCacheManager(10, BLOCK_SIZE, [sliding, full], max_model_len=64)
    manager.enable_kv_events()
    request = make_request("a", list(range(12)))  # 3 full blocks
    for num_tokens in (4, 4, 4):  # a block a step: the window gives blocks back
        assert manager.allocate_slots(request, num_tokens) is not None
        request.num_computed_tokens += num_tokens
    stored = [event for event in manager.take_events() if isinstance(event, BlockStored)]
    assert [(event.group_idx, event.block_hashes) for event in stored] == [
        (g, [request.block_hashes[i]]) for i in range(3) for g in (0, 1)
    ]
    assert [event.kv_cache_spec_kind for event in stored[:2]] == [
        "sliding_window",
        "full_attention",
    ]
    assert [event.kv_cache_spec_sliding_window for event in stored[:2]] == [4, None]
    assert stored[2].parent_block_hash == request.block_hashes[0]
    manager.free(request)
    # 9 usable blocks, 3 never used; 4 blocks a group evict the sliding block that left
    # the window first, then the request's tails (each group's reversed, group after group).
    other = make_request("b", list(range(100, 116)))
    assert manager.allocate_slots(other, 16) is not None
    removed = [event for event in manager.take_events() if isinstance(event, BlockRemoved)]
    hashes = request.block_hashes
    assert [(event.group_idx, event.block_hashes) for event in removed] == [
        (0, [hashes[0]]),
        (0, [hashes[2]]),
        (0, [hashes[1]]),
        (1, [hashes[2]]),
        (1, [hashes[1]]),
    ]
    manager.free(other)
    assert_all_blocks_free(manager)


def test_no_events_are_collected_unless_enabled():
    manager = KVCacheManager(16, BLOCK_SIZE, True, max_model_len=64)
    admit(manager, make_request("a", list(range(10))))
    assert manager.block_pool.kv_events is None and manager.take_events() == []


def test_config_flag_parses_and_refuses_bad_fields():
    config = EngineConfig.from_kwargs(
        kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq"}
    )
    assert config.kv_events_config is not None and config.kv_events_config.is_publishing
    with pytest.raises(msgspec.ValidationError, match="publisher"):
        msgspec.convert({"publisher": "kafka"}, KVEventsConfig)
    with pytest.raises(msgspec.ValidationError, match="buffer_steps"):
        msgspec.convert({"buffer_steps": 0}, KVEventsConfig)
    with pytest.raises(msgspec.ValidationError, match="udp://"):
        msgspec.convert({"endpoint": "udp://x:1"}, KVEventsConfig)
    with pytest.raises(ValueError, match="needs prefix caching"):
        EngineConfig.from_kwargs(
            enable_prefix_caching=False,
            kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq"},
        )


def test_each_dp_engine_gets_its_own_address():
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("tcp://*:0", 2) == "tcp://*:0"
    assert offset_endpoint("ipc:///tmp/ev", 1) == "ipc:///tmp/ev_dp1"
    assert is_bind_endpoint("tcp://*:5557") and is_bind_endpoint("ipc:///tmp/ev")
    assert not is_bind_endpoint("tcp://10.0.0.1:5557")


def _batch(num: int) -> KVEventBatch:
    return KVEventBatch(ts=float(num), events=[BlockRemoved(block_hashes=[num], medium="GPU")])


def test_publisher_numbers_batches_and_replays_from_a_sequence(tmp_path):
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"ipc://{tmp_path}/events",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        topic="kv",
    )
    publisher = KVEventPublisher(config, data_parallel_rank=1)
    assert publisher.endpoint.endswith("events_dp1")
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(publisher.endpoint)
        time.sleep(0.3)  # PUB drops what it sends before the subscription arrives
        for num in range(3):
            publisher.publish(_batch(num))
        received = []
        for _ in range(3):
            assert sub.poll(5000), "no batch published"
            topic, seq, payload = sub.recv_multipart()
            batch = decode_batch(payload)
            received.append((topic, int.from_bytes(seq, "big"), batch.events[0].block_hashes))
            assert batch.data_parallel_rank == 1
        assert received == [(b"kv", 0, [0]), (b"kv", 1, [1]), (b"kv", 2, [2])]

        # vLLM's replay request from a DEALER: [b"", start seq]; answers [b"", topic, seq,
        # payload] per buffered batch, then [b"", b"", END_SEQ, b""].
        replay = ctx.socket(zmq.DEALER)
        replay.connect(publisher.replay_endpoint)
        replay.send_multipart([b"", (1).to_bytes(8, "big")])
        replayed = []
        while True:
            assert replay.poll(5000), "replay did not answer"
            empty, topic, seq, payload = replay.recv_multipart()
            if seq == END_SEQ:
                assert (empty, topic, payload) == (b"", b"", b"")
                break
            replayed.append((topic, int.from_bytes(seq, "big"), decode_batch(payload).ts))
        assert replayed == [(b"kv", 1, 1.0), (b"kv", 2, 2.0)]
    finally:
        publisher.shutdown()
        ctx.destroy(linger=0)


def test_tcp_sockets_are_curve_and_strangers_get_nothing(tmp_path, monkeypatch):
    folder = str(tmp_path / "keys")
    generate_keys(folder)
    monkeypatch.setenv(TRANSPORT_KEYS.name, folder)
    port, replay_port = free_port(), free_port()
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{replay_port}",
    )
    publisher = KVEventPublisher(config, data_parallel_rank=0)
    ctx = zmq.Context()
    try:
        stranger = ctx.socket(zmq.SUB)  # plain tcp: never finishes the CURVE handshake
        stranger.linger = 0
        stranger.subscribe(b"")
        stranger.connect(f"tcp://127.0.0.1:{port}")
        ours = make_socket(ctx, f"tcp://127.0.0.1:{port}", zmq.SUB, bind=False)
        time.sleep(0.5)
        publisher.publish(_batch(5))
        assert ours.poll(5000), "a keyed subscriber got nothing"
        _, seq, payload = ours.recv_multipart()
        assert (int.from_bytes(seq, "big"), decode_batch(payload).ts) == (0, 5.0)
        assert not stranger.poll(500)

        replay = make_socket(ctx, f"tcp://127.0.0.1:{replay_port}", zmq.DEALER, bind=False)
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        assert replay.poll(5000)
        assert replay.recv_multipart()[2] == (0).to_bytes(8, "big")
    finally:
        publisher.shutdown()
        ctx.destroy(linger=0)


@pytest.mark.parametrize("command", ["serve", "kv-events"])
def test_tcp_events_without_keys_are_refused_before_starting(command, monkeypatch, capsys):
    monkeypatch.delenv(TRANSPORT_KEYS.name, raising=False)
    monkeypatch.delenv(INSECURE_TRANSPORT.name, raising=False)
    monkeypatch.setattr(transport_security, "_warned_insecure", False)
    config = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}'
    argv = {
        "serve": ["serve", "/nonexistent-model", "--kv-events-config", config],
        "kv-events": ["kv-events", "--addr", "tcp://127.0.0.1:5557"],
    }[command]
    with pytest.raises(SystemExit) as exited:
        main(argv)  # refused before a model is looked for or a socket made
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"{command}:" in err and "--transport-keys" in err
