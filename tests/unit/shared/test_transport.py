"""The engine socket protocol over real ZeroMQ sockets: every message type round-trips
typed, arrays travel as extra frames, and bad input fails loudly."""

from __future__ import annotations

import os

import msgspec
import numpy as np
import pytest
import zmq

from kvserve.shared.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    Logprobs,
    SchedulerStats,
)
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.transport import (
    INLINE_ARRAY_MAX_BYTES,
    EngineAddresses,
    MessageDecoder,
    MessageEncoder,
    MsgpackDecoder,
    MsgpackEncoder,
    engine_identity,
    make_socket,
)
from kvserve.shared.wire import (
    EngineDead,
    EngineHeartbeat,
    EngineReady,
    EngineStats,
    GetStats,
    MsgType,
    Ping,
    ResetPrefixCache,
    UtilityCall,
    UtilityOutput,
)

API_TO_ENGINE = (MsgType.ADD, MsgType.ABORT, MsgType.UTILITY)
ENGINE_TO_API = (MsgType.OUTPUTS, MsgType.UTILITY_OUTPUT, MsgType.HEARTBEAT, MsgType.DEAD)

REQUEST = EngineCoreRequest(
    request_id="req-1",
    prompt_token_ids=[1, 2, 3, 49151],
    sampling_params=SamplingParams(temperature=0.7, top_k=5, stop=["\n"], seed=3, logprobs=2),
    eos_token_id=2,
    arrival_time=123.5,
    priority=-1,
    cache_salt="salt",
)
OUTPUTS = EngineCoreOutputs(
    outputs=[
        EngineCoreOutput(
            "req-1",
            [7, 8],
            new_logprobs=Logprobs(
                token_ids=[[7, 1], [8, 3]], logprobs=[[-0.1, -2.5], [-0.2, -1.0]], ranks=[1, 1]
            ),
        ),
        EngineCoreOutput("req-2", [], finish_reason=FinishReason.ERROR, error="bad"),
    ],
    scheduler_stats=SchedulerStats(num_running_reqs=1, kv_cache_usage=0.25),
    timestamp=5.0,
    engine_index=3,
)


@pytest.fixture
def sockets():
    """api ROUTER + PULL bound on fresh ipc addresses, engine DEALER + PUSH connected."""
    ctx = zmq.Context()
    addresses = EngineAddresses.local()
    router = make_socket(ctx, addresses.input_addr, zmq.ROUTER, bind=True)
    pull = make_socket(ctx, addresses.output_addr, zmq.PULL, bind=True)
    dealer = make_socket(
        ctx, addresses.input_addr, zmq.DEALER, bind=False, identity=engine_identity(1)
    )
    push = make_socket(ctx, addresses.output_addr, zmq.PUSH, bind=False)
    for sock in (router, pull, dealer, push):
        sock.setsockopt(zmq.RCVTIMEO, 5000)
    yield router, pull, dealer, push
    ctx.destroy(linger=0)
    addresses.remove_ipc_files()


def test_every_message_round_trips_over_real_sockets(sockets):
    router, pull, dealer, push = sockets
    encoder = MessageEncoder()
    handshake = EngineReady(
        engine_index=1,
        num_blocks=100,
        max_model_len=512,
        block_size=16,
        hostname="h",
        pid=42,
        worker_pids=[43, 44],
    )
    # READY is the DEALER's first message: the ROUTER learns the engine's identity from it.
    dealer.send_multipart(encoder.encode(MsgType.READY, handshake))
    identity, *frames = router.recv_multipart()
    assert identity == engine_identity(1)
    assert MessageDecoder((MsgType.READY,)).decode(frames) == (MsgType.READY, handshake)

    to_engine = [(MsgType.ADD, REQUEST), (MsgType.ABORT, ["req-1", "req-2"])]
    to_engine += [
        (MsgType.UTILITY, UtilityCall(i, method))
        for i, method in enumerate([ResetPrefixCache(), GetStats(), Ping()])
    ]
    engine_decoder = MessageDecoder(API_TO_ENGINE)
    for msg_type, payload in to_engine:
        router.send_multipart([identity, *encoder.encode(msg_type, payload)])
        assert engine_decoder.decode(dealer.recv_multipart(copy=False)) == (msg_type, payload)

    heartbeat = EngineHeartbeat(1, num_iterations=9, num_steps=7, idle=True, num_unfinished_reqs=0)
    to_api = [
        (MsgType.OUTPUTS, OUTPUTS),
        (MsgType.HEARTBEAT, heartbeat),
        (MsgType.DEAD, EngineDead(1, "RuntimeError: boom")),
    ]
    to_api += [
        (MsgType.UTILITY_OUTPUT, UtilityOutput(i, result=result))
        for i, result in enumerate([True, EngineStats(10, 9, 1, 0, 5, 2), heartbeat, None])
    ]
    to_api.append((MsgType.UTILITY_OUTPUT, UtilityOutput(9, failure_message="ValueError: x")))
    api_decoder = MessageDecoder(ENGINE_TO_API)
    for msg_type, payload in to_api:
        push.send_multipart(encoder.encode(msg_type, payload))
        assert api_decoder.decode(pull.recv_multipart(copy=False)) == (msg_type, payload)


def test_utility_call_names_its_method():
    assert UtilityCall(0, ResetPrefixCache()).method_name == "reset_prefix_cache"
    assert UtilityCall(0, GetStats()).method_name == "get_stats"


def test_message_types_are_one_byte_frames():
    frames = MessageEncoder().encode(MsgType.ABORT, ["a"])
    assert frames[0] == bytes([MsgType.ABORT]) and len(frames) == 2


class _WithArrays(msgspec.Struct):
    small: np.ndarray
    big: np.ndarray
    nested: list[np.ndarray]


def test_numpy_arrays_inline_when_small_and_as_zero_copy_frames_when_big(sockets):
    _, pull, _, push = sockets
    small = np.arange(4, dtype=np.int32)
    big = np.arange(1000, dtype=np.int64).reshape(10, 100)
    strided = np.arange(200, dtype=np.float32)[::2]  # not contiguous: sent as a copy
    assert small.nbytes < INLINE_ARRAY_MAX_BYTES <= big.nbytes
    frames = MsgpackEncoder().encode(_WithArrays(small, big, [strided]))
    assert len(frames) == 3  # payload + big + strided; small rides in the payload

    push.send_multipart(frames, copy=False)
    received = pull.recv_multipart(copy=False)
    decoded = MsgpackDecoder(_WithArrays).decode([f.buffer for f in received])
    np.testing.assert_array_equal(decoded.small, small)
    np.testing.assert_array_equal(decoded.big, big)
    np.testing.assert_array_equal(decoded.nested[0], strided)
    assert decoded.big.dtype == np.int64 and decoded.big.shape == (10, 100)
    # The big array is a view on the received frame, not a copy.
    assert not decoded.big.flags.owndata
    assert np.shares_memory(decoded.big, np.frombuffer(received[1].buffer, np.uint8))


def test_objects_that_are_not_msgspec_or_numpy_are_refused():
    with pytest.raises(TypeError, match="never pickle"):
        MsgpackEncoder().encode({"x": object()})


def test_decoder_rejects_unexpected_type_and_invalid_payload():
    encoder = MessageEncoder()
    engine_decoder = MessageDecoder(API_TO_ENGINE)
    with pytest.raises(ValueError, match="unexpected message type 11"):
        engine_decoder.decode(encoder.encode(MsgType.OUTPUTS, OUTPUTS))
    with pytest.raises(ValueError, match="unexpected message type 99"):
        engine_decoder.decode([bytes([99]), b"\x90"])
    with pytest.raises(ValueError, match="malformed message"):
        engine_decoder.decode([b"\x00"])
    # An ABORT whose payload is not a list of ids fails msgspec's typed validation.
    bad = [MsgType.ABORT.frame, msgspec.msgpack.encode([1, 2])]
    with pytest.raises(msgspec.ValidationError):
        engine_decoder.decode(bad)


def test_router_refuses_to_send_to_an_unknown_engine(sockets):
    router = sockets[0]
    with pytest.raises(zmq.ZMQError):
        router.send_multipart([engine_identity(7), *MessageEncoder().encode(MsgType.ABORT, ["x"])])


def test_make_socket_validates_the_address():
    ctx = zmq.Context()
    try:
        with pytest.raises(ValueError, match="tcp://"):
            make_socket(ctx, "localhost:5555", zmq.PUSH, bind=False)
    finally:
        ctx.destroy(linger=0)


def test_local_addresses_are_unique_ipc_paths_removed_after_use():
    a, b = EngineAddresses.local(), EngineAddresses.local()
    assert a.input_addr.startswith("ipc://") and a.output_addr.startswith("ipc://")
    assert len({a.input_addr, a.output_addr, b.input_addr, b.output_addr}) == 4
    ctx = zmq.Context()
    make_socket(ctx, a.input_addr, zmq.ROUTER, bind=True)
    make_socket(ctx, a.output_addr, zmq.PULL, bind=True)
    paths = [a.input_addr.removeprefix("ipc://"), a.output_addr.removeprefix("ipc://")]
    assert all(os.path.exists(path) for path in paths)
    ctx.destroy(linger=0)
    a.remove_ipc_files()
    b.remove_ipc_files()  # never bound: its private folder goes all the same
    assert not any(os.path.exists(path) for path in paths)
    folders = {
        os.path.dirname(addr.removeprefix("ipc://")) for addr in (a.input_addr, b.input_addr)
    }
    assert not any(os.path.exists(folder) for folder in folders)
