"""Fuzzed frames from a peer that holds the deployment's keys never crash or hang an engine
core or the KV store: each malformed frame is dropped (the store logs one line for each, or
answers an error), and the process serves a normal request right after. A peer without the
key gets nothing at all. (The workers' result socket: test_collective_rpc.py.)

Hypothesis draws the frames, a bounded number of examples per server: bytes at random,
valid messages cut short, and valid messages with one byte changed. One real server per
test, started once: a `kvserve kv-store` on CURVE tcp://, an engine core of the tiny random
Llama with a worker process, driven by the api's own client over its real sockets.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.launch.engines import stop_engine_process
from kvserve.services.api.serving.tokenizer import TokenizerInfo
from kvserve.services.kv_store.client import KvStoreClient
from kvserve.shared.env import TRANSPORT_KEYS
from kvserve.shared.messages import (
    EngineCoreRequest,
    KvGet,
    KvHello,
    KvLookup,
    KvPut,
    KvStatsQuery,
    KvStatsReply,
    KvStoreReply,
)
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.transport import MessageEncoder, make_socket
from kvserve.shared.transport_security import generate_keys
from kvserve.shared.wire import MsgType, Ping, UtilityCall
from tests.support.engine import start_engine
from tests.support.kv_store import StoreProcess, chain, random_caches, tiny_fingerprint

pytestmark = pytest.mark.slow

REPLY_TIMEOUT_MS = 10_000  # a store that hangs fails here, not by stalling the suite
FUZZ = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _frames_from(seeds: list[bytes]) -> st.SearchStrategy[bytes]:
    """Bytes at random, a seed cut short, or a seed with one byte changed."""
    cut = st.sampled_from(seeds).flatmap(
        lambda seed: st.integers(0, len(seed) - 1).map(lambda n: seed[:n])
    )
    changed = st.sampled_from(seeds).flatmap(
        lambda seed: st.tuples(st.integers(0, len(seed) - 1), st.integers(0, 255)).map(
            lambda edit: seed[: edit[0]] + bytes([edit[1]]) + seed[edit[0] + 1 :]
        )
    )
    return st.one_of(st.binary(max_size=64), cut, changed)


# ------------------------------------------------------------------------------- KV store

STORE_SEEDS = [
    msgspec.msgpack.encode(request)
    for request in (
        KvHello(1, tiny_fingerprint()),
        KvLookup(2, b"pool", chain("seed", 2)),
        KvPut(3, b"pool", chain("seed", 1)),
        KvGet(4, b"pool", chain("seed", 2), as_frames=True),
        KvStatsQuery(5),
    )
]


@pytest.fixture(scope="module")
def keyed_store(tmp_path_factory) -> Iterator[tuple[StoreProcess, str]]:
    """A store on CURVE tcp:// (the keys in TRANSPORT_KEYS for it and for this process's
    sockets) and its log's path."""
    folder = str(tmp_path_factory.mktemp("keys"))
    generate_keys(folder)
    log_path = str(tmp_path_factory.mktemp("store") / "store.log")
    previous = os.environ.get(TRANSPORT_KEYS.name)
    os.environ[TRANSPORT_KEYS.name] = folder
    store = StoreProcess("--size", "1M", log_path=log_path)
    try:
        yield store, log_path
        assert store.stop() == 0
    finally:
        if previous is None:
            del os.environ[TRANSPORT_KEYS.name]
        else:
            os.environ[TRANSPORT_KEYS.name] = previous


@pytest.fixture(scope="module")
def keyed_peer(keyed_store) -> Iterator[zmq.Socket]:
    ctx = zmq.Context()
    peer = make_socket(ctx, keyed_store[0].tcp, zmq.DEALER, bind=False)
    yield peer
    ctx.destroy(linger=0)


_call_ids = itertools.count(1_000_000)  # above any call id the fuzzed seeds carry


def _num_dropped(log_path: str) -> int:
    with open(log_path) as log:
        return len(re.findall(r"KV store: dropped", log.read()))


def _replies_until_stats(peer: zmq.Socket) -> int:
    """Ask for the stats; the number of replies that came before them (answers to what was
    sent before, in order: one ROUTER peer's messages are handled first in, first out)."""
    call_id = next(_call_ids)
    peer.send(msgspec.msgpack.encode(KvStatsQuery(call_id)))
    decoder = msgspec.msgpack.Decoder(KvStoreReply)
    for num_before in itertools.count():
        assert peer.poll(REPLY_TIMEOUT_MS), "the store stopped answering"
        reply = decoder.decode(peer.recv_multipart()[0])
        if isinstance(reply, KvStatsReply) and reply.call_id == call_id:
            return num_before
    raise AssertionError("unreachable")


@FUZZ
@given(
    messages=st.lists(
        st.tuples(_frames_from(STORE_SEEDS), st.lists(st.binary(max_size=64), max_size=2)),
        min_size=1,
        max_size=4,
    )
)
def test_the_store_drops_fuzzed_frames_and_serves_on(keyed_store, keyed_peer, messages):
    store, log_path = keyed_store
    dropped_before = _num_dropped(log_path)
    for payload, data in messages:
        keyed_peer.send_multipart([payload, *data])
    num_answered = _replies_until_stats(keyed_peer)
    # Each message was answered (an error, most) or dropped with one line, none both.
    assert _wait_dropped(log_path, dropped_before + len(messages) - num_answered)
    assert store.proc.poll() is None


def _wait_dropped(log_path: str, expected: int, timeout_s: float = 5.0) -> bool:
    """The store's log holds `expected` 'dropped' lines (its writes may trail its replies)."""
    deadline = time.monotonic() + timeout_s
    while _num_dropped(log_path) < expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return _num_dropped(log_path) == expected


def test_after_the_fuzzing_the_store_moves_blocks_and_strangers_get_nothing(keyed_store):
    store, _ = keyed_store
    fingerprint = tiny_fingerprint()
    src = random_caches(fingerprint, 4, seed=3)
    with KvStoreClient(store.tcp, fingerprint, timeout_s=10) as client:
        assert client.put(chain("after-fuzz", 2), src, [0, 1]) == 2
        assert client.lookup(chain("after-fuzz", 2)) == 2
    ctx = zmq.Context()
    try:
        stranger = ctx.socket(zmq.DEALER)  # plain tcp, no key: the handshake never completes
        stranger.linger = 0
        stranger.connect(store.tcp)
        stranger.send(msgspec.msgpack.encode(KvStatsQuery(1)), zmq.NOBLOCK)
        assert not stranger.poll(1000), "a peer without the key got an answer"
    finally:
        ctx.destroy(linger=0)
    assert store.proc.poll() is None


# ---------------------------------------------------------------------------- engine core

_ADD = EngineCoreRequest(
    request_id="seed",
    prompt_token_ids=[1, 2, 3],
    sampling_params=SamplingParams(max_tokens=2, temperature=0.0),
    eos_token_id=None,
    arrival_time=0.0,
)
_ENGINE_TYPES = [MsgType.ADD, MsgType.ABORT, MsgType.UTILITY, MsgType.FRONTEND_HEARTBEAT]
ENGINE_SEEDS = [
    frames[1]
    for frames in (
        MessageEncoder().encode(MsgType.ADD, _ADD),
        MessageEncoder().encode(MsgType.ABORT, ["seed"]),
        MessageEncoder().encode(MsgType.UTILITY, UtilityCall(7, Ping())),
    )
]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> Iterator[tuple[asyncio.AbstractEventLoop, object]]:
    """(the loop it runs on, the api's client) of an engine core with one worker process."""
    loop = asyncio.new_event_loop()
    client, process = loop.run_until_complete(
        start_engine(tiny_llama_dir, TokenizerInfo(tiny_llama_dir), executor="mp")
    )
    try:
        yield loop, client
        assert process.is_alive(), "the engine core died"
    finally:
        loop.run_until_complete(client.shutdown())
        stop_engine_process(process)
        loop.close()


@FUZZ
@given(
    messages=st.lists(
        st.tuples(
            st.one_of(st.sampled_from([t.frame for t in _ENGINE_TYPES]), st.binary(max_size=2)),
            _frames_from(ENGINE_SEEDS),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_an_engine_core_drops_fuzzed_frames_and_serves_on(engine, messages):
    loop, client = engine

    async def send_then_ping() -> None:
        for type_frame, payload in messages:
            frames = [client.engines[0].identity, type_frame, payload]
            await client.channel.input_socket.send_multipart(frames)
        # Answered by the busy loop after the input thread took every frame above in order.
        await client.ping(timeout_s=10)

    loop.run_until_complete(send_then_ping())
    assert client.is_healthy, client.health_report()


def test_after_the_fuzzing_the_engine_core_serves_a_request(engine):
    loop, client = engine
    params = SamplingParams(max_tokens=4, temperature=0.0)

    async def generate() -> list:
        return [out async for out in client.generate("after-fuzz", None, [5, 6, 7], params)]

    outputs = loop.run_until_complete(asyncio.wait_for(generate(), 60))
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 4
