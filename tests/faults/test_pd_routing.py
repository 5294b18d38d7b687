"""MPEngineClient's P/D routing against scripted engine peers (real sockets, real codec).

Engines say their kv_role in READY, as local, compose and headless engines all do: a request
goes to a kv_producer first as a one-token copy, then, once that finished, to a consumer. A
client gone during the prefill aborts it there; a prefill engine that dies is retried on
another; with none left the request fails with EngineDeadError. An engine silent past the
heartbeat timeout is suspect: it gets no new request (nor prefill copy) while another of its
pool serves, and the next message from it puts it back.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import zmq
import zmq.asyncio

from kvserve.services.api.engine_client.client import EngineDeadError
from kvserve.services.api.engine_client.mp_client import (
    ClientTopology,
    EngineChannel,
    MPEngineClient,
)
from kvserve.services.api.serving.base import OpenAIServing
from kvserve.services.api.serving.tokenizer import TokenizerInfo
from kvserve.shared.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.transport import (
    EngineAddresses,
    MessageDecoder,
    MessageEncoder,
    engine_identity,
    make_socket,
)
from kvserve.shared.wire import EngineDead, EngineHeartbeat, EngineReady, MsgType
from tests.support.waiting import wait_until_async

HEARTBEAT_INTERVAL_S = 0.1
SHORT_HEARTBEAT_TIMEOUT_S = 0.5  # for the suspect-engine tests
PROMPT = [1, 2, 3, 4, 5]
PARAMS = SamplingParams(temperature=0.7, max_tokens=3, stop=["x"], logprobs=2, min_tokens=2)


@pytest.fixture(scope="module")
def tokenizer_info(tiny_llama_dir) -> TokenizerInfo:
    return TokenizerInfo(tiny_llama_dir)


@pytest.fixture(autouse=True)
def fast_liveness(monkeypatch):
    monkeypatch.setenv("KVSERVE_ENGINE_HEARTBEAT_INTERVAL_S", str(HEARTBEAT_INTERVAL_S))
    monkeypatch.setenv("KVSERVE_ENGINE_HEARTBEAT_TIMEOUT_S", "5")


class RoleEngine:
    """One engine's side of the protocol, with a kv_role, beating while `beating`, until
    closed."""

    def __init__(self, addresses: EngineAddresses, engine_index: int, kv_role: str | None):
        self.engine_index, self.kv_role = engine_index, kv_role
        self.ctx = zmq.asyncio.Context()
        self.dealer = make_socket(
            self.ctx,
            addresses.input_addr,
            zmq.DEALER,
            bind=False,
            identity=engine_identity(engine_index),
        )
        self.push = make_socket(self.ctx, addresses.output_addr, zmq.PUSH, bind=False)
        self.encoder = MessageEncoder()
        self.decoder = MessageDecoder(
            (MsgType.ADD, MsgType.ABORT, MsgType.UTILITY, MsgType.FRONTEND_HEARTBEAT)
        )
        self.num_frontend_heartbeats = 0
        self.beating = True
        self.beat_task: asyncio.Task | None = None

    async def start(self) -> None:
        handshake = EngineReady(
            engine_index=self.engine_index,
            num_blocks=64,
            max_model_len=128,
            block_size=16,
            hostname="scripted-host",  # not this host: only heartbeats are watched
            pid=1,
            kv_role=self.kv_role,
        )
        await self.dealer.send_multipart(self.encoder.encode(MsgType.READY, handshake))
        self.beat_task = asyncio.create_task(self._beat())

    async def _beat(self) -> None:
        while True:
            if self.beating:
                heartbeat = EngineHeartbeat(self.engine_index, 0, 0, True, 0)
                await self.send(MsgType.HEARTBEAT, heartbeat)
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def send(self, msg_type: MsgType, payload) -> None:
        await self.push.send_multipart(self.encoder.encode(msg_type, payload))

    async def finish(self, request_id: str, token_ids: list[int]) -> None:
        output = EngineCoreOutput(request_id, token_ids, finish_reason=FinishReason.LENGTH)
        await self.send(
            MsgType.OUTPUTS, EngineCoreOutputs(outputs=[output], engine_index=self.engine_index)
        )

    async def die(self) -> None:
        await self.send(MsgType.DEAD, EngineDead(self.engine_index, "scripted death"))
        self.close()

    async def recv(self, timeout_s: float = 5.0):
        """The next message from the api that is not one of its heartbeats."""
        async with asyncio.timeout(timeout_s):
            while True:
                msg_type, payload = self.decoder.decode(await self.dealer.recv_multipart())
                if msg_type != MsgType.FRONTEND_HEARTBEAT:
                    return msg_type, payload
                self.num_frontend_heartbeats += 1

    async def assert_silent(self, timeout_s: float = 0.3) -> None:
        with pytest.raises(TimeoutError):
            await self.recv(timeout_s)

    def close(self) -> None:
        if self.beat_task is not None:
            self.beat_task.cancel()
            self.beat_task = None
        self.ctx.destroy(linger=0)


def _scenario(
    tokenizer_info, roles: list[str | None], body, wait_for_restarts: bool = False
) -> None:
    """body(client, engines) against engines 0..len(roles)-1 of these roles (a client that
    waits for restarted engines when `wait_for_restarts`, as with --restart-dead-engines)."""

    async def main():
        channel = EngineChannel(EngineAddresses.local())
        engines = [RoleEngine(channel.addresses, i, role) for i, role in enumerate(roles)]
        for engine in engines:
            await engine.start()
        client = await MPEngineClient.connect(
            channel,
            tokenizer_info,
            "tiny",
            ready_timeout_s=5,
            topology=ClientTopology(num_engines=len(roles), wait_for_restarts=wait_for_restarts),
        )
        try:
            await body(client, engines)
        finally:
            await client.shutdown()
            for engine in engines:
                engine.close()

    asyncio.run(main())


async def _collect(client: MPEngineClient, request_id: str) -> list:
    return [out async for out in client.generate(request_id, None, PROMPT, PARAMS)]


def test_prefill_copy_first_then_the_request_on_a_decode_engine(tokenizer_info):
    async def body(client, engines):
        prefill, decode = engines
        task = asyncio.create_task(_collect(client, "r1"))
        msg_type, copy = await prefill.recv()
        assert msg_type == MsgType.ADD and copy.request_id == "r1-prefill"
        assert copy.prompt_token_ids == PROMPT
        params = copy.sampling_params
        assert (params.n, params.max_tokens, params.min_tokens) == (1, 1, 0)
        assert params.stop is None and params.logprobs is None and params.prompt_logprobs is None
        await decode.assert_silent()  # the decode waits for the prefill
        await prefill.finish("r1-prefill", [9])
        msg_type, request = await decode.recv()
        assert msg_type == MsgType.ADD and request.request_id == "r1"
        assert request.sampling_params.max_tokens == 3 and request.sampling_params.logprobs == 2
        await decode.finish("r1", [65, 66, 67])
        outputs = await asyncio.wait_for(task, 5)
        assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == [65, 66, 67]

        report = client.health_report()
        assert report["status"] == "healthy"
        assert [e["kv_role"] for e in report["engines"]] == ["kv_producer", "kv_consumer"]

    _scenario(tokenizer_info, ["kv_producer", "kv_consumer"], body)


def test_mixed_roles_pool_by_role_and_no_producer_means_no_pd(tokenizer_info):
    async def body(client, engines):
        assert client.prefill_ids == {1} and client.decode_ids == {0, 2}

    _scenario(tokenizer_info, ["kv_both", "kv_producer", None], body)

    async def plain(client, engines):
        assert not client.prefill_ids  # every engine computes its own requests
        task = asyncio.create_task(_collect(client, "r1"))
        _, request = await engines[0].recv()
        assert request.request_id == "r1"
        await engines[0].finish("r1", [65])
        await asyncio.wait_for(task, 5)

    _scenario(tokenizer_info, ["kv_both"], plain)


def test_a_client_gone_while_prefilling_aborts_the_copy(tokenizer_info):
    async def body(client, engines):
        prefill, decode = engines
        task = asyncio.create_task(_collect(client, "r1"))
        await prefill.recv()
        task.cancel()
        msg_type, request_ids = await prefill.recv()
        assert msg_type == MsgType.ABORT and request_ids == ["r1-prefill"]
        await decode.assert_silent()
        assert not client.flow.prefills and not client.queues

    _scenario(tokenizer_info, ["kv_producer", "kv_consumer"], body)


def test_a_dead_prefill_engine_is_retried_once_then_fails(tokenizer_info):
    async def body(client, engines):
        decode = engines[2]
        task = asyncio.create_task(_collect(client, "r1"))
        first = await _engine_that_got(engines[:2], "r1-prefill")
        await first.die()
        second = await _engine_that_got([e for e in engines[:2] if e is not first], "r1-prefill")
        await second.finish("r1-prefill", [9])
        _, request = await decode.recv()
        assert request.request_id == "r1"
        await decode.finish("r1", [65, 66, 67])
        assert (await asyncio.wait_for(task, 5))[-1].finished
        assert client.is_healthy

        task = asyncio.create_task(_collect(client, "r2"))
        await second.recv()
        await second.die()
        with pytest.raises(EngineDeadError, match="no prefill engine core is left"):
            await asyncio.wait_for(task, 5)
        await decode.assert_silent()
        assert client.dead_reason is not None and "prefill" in client.dead_reason

    _scenario(tokenizer_info, ["kv_producer", "kv_producer", "kv_consumer"], body)


async def _engine_that_got(engines: list[RoleEngine], request_id: str) -> RoleEngine:
    receives = {asyncio.create_task(engine.recv()): engine for engine in engines}
    done, pending = await asyncio.wait(receives, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    (task,) = done
    msg_type, request = task.result()
    assert msg_type == MsgType.ADD and request.request_id == request_id
    return receives[task]


async def _silence(client: MPEngineClient, engine: RoleEngine) -> None:
    """Stop the engine's heartbeats and wait until the client takes it for suspect."""
    engine.beating = False
    index = engine.engine_index
    await wait_until_async(lambda: client.engines[index].is_suspect, timeout_s=5)
    entry = client.health_report()["engines"][index]
    assert entry["state"] == "suspect" and "sent nothing for" in entry["reason"], entry


def test_a_suspect_engine_gets_no_new_requests_while_another_serves(tokenizer_info, monkeypatch):
    monkeypatch.setenv("KVSERVE_ENGINE_HEARTBEAT_TIMEOUT_S", str(SHORT_HEARTBEAT_TIMEOUT_S))

    async def body(client, engines):
        serving, suspect = engines
        await _silence(client, suspect)
        report = client.health_report()
        assert report["status"] == "degraded" and client.is_healthy, report
        for i in range(4):  # idle engines tie, and ties go round-robin: both would get some
            task = asyncio.create_task(_collect(client, f"r{i}"))
            _, request = await serving.recv()
            assert request.request_id.startswith(f"r{i}")
            await serving.finish(request.request_id, [65, 66, 67])
            assert (await asyncio.wait_for(task, 5))[-1].finished
        await suspect.assert_silent()

        suspect.beating = True  # its next message puts it back
        await wait_until_async(lambda: not client.engines[1].is_suspect, timeout_s=2)
        assert client.health_report()["status"] == "healthy"
        # The router's own estimates (no coordinator here) now favour it: it takes the next.
        task = asyncio.create_task(_collect(client, "s0"))
        _, request = await suspect.recv()
        assert request.request_id.startswith("s0")
        await suspect.finish(request.request_id, [65, 66, 67])
        assert (await asyncio.wait_for(task, 5))[-1].finished

    _scenario(tokenizer_info, [None, None], body)


def test_a_suspect_prefill_engine_is_passed_over_but_a_lone_one_still_gets_work(
    tokenizer_info, monkeypatch
):
    monkeypatch.setenv("KVSERVE_ENGINE_HEARTBEAT_TIMEOUT_S", str(SHORT_HEARTBEAT_TIMEOUT_S))

    async def body(client, engines):
        first, second, decode = engines
        await _silence(client, first)
        for i in range(2):
            task = asyncio.create_task(_collect(client, f"r{i}"))
            _, copy = await second.recv()
            assert copy.request_id == f"r{i}-prefill"
            await second.finish(copy.request_id, [9])
            _, request = await decode.recv()
            await decode.finish(request.request_id, [65, 66, 67])
            assert (await asyncio.wait_for(task, 5))[-1].finished
        await first.assert_silent()

        # Every prefill engine suspect: the copy waits on one of them rather than fail.
        await _silence(client, second)
        assert client.is_healthy
        task = asyncio.create_task(_collect(client, "r2"))
        holder = await _engine_that_got([first, second], "r2-prefill")
        holder.beating = True  # it was only slow
        await holder.finish("r2-prefill", [9])
        _, request = await decode.recv()
        await decode.finish(request.request_id, [65, 66, 67])
        assert (await asyncio.wait_for(task, 5))[-1].finished

    _scenario(tokenizer_info, ["kv_producer", "kv_producer", "kv_consumer"], body)


def _assert_requests_are_taken(client: MPEngineClient) -> None:
    """Every engine of some stage is suspect, yet new requests are admitted (not a 503), and
    not held for a restart either: they queue to a suspect engine."""
    assert client.is_healthy and not client.waits_for_engine
    assert client.health_report()["status"] == "degraded"
    OpenAIServing(client, "tiny").check_engine()  # the api's gate before every request


def test_a_lone_suspect_prefill_engine_queues_new_requests(tokenizer_info, monkeypatch, caplog):
    """--prefill-size 1 --decode-size 1 --restart-dead-engines: the prefill engine turns
    suspect (paused) before the request comes; the request's prefill copy waits on it and
    the request completes once it speaks again."""
    monkeypatch.setenv("KVSERVE_ENGINE_HEARTBEAT_TIMEOUT_S", str(SHORT_HEARTBEAT_TIMEOUT_S))

    async def body(client, engines):
        prefill, decode = engines
        await _silence(client, prefill)
        _assert_requests_are_taken(client)
        with caplog.at_level(logging.WARNING, logger="kvserve"):
            task = asyncio.create_task(_collect(client, "r1"))
            _, copy = await prefill.recv()
        assert copy.request_id == "r1-prefill"
        assert any(
            "request r1-prefill queued to suspect engine core 0" in r.getMessage()
            for r in caplog.records
        )
        await decode.assert_silent()  # the decode waits for the prefill
        prefill.beating = True  # it was only paused
        await wait_until_async(lambda: not client.engines[0].is_suspect, timeout_s=2)
        await prefill.finish(copy.request_id, [9])
        _, request = await decode.recv()
        await decode.finish(request.request_id, [65, 66, 67])
        assert (await asyncio.wait_for(task, 5))[-1].outputs[0].token_ids == [65, 66, 67]
        assert client.health_report()["status"] == "healthy"

    _scenario(tokenizer_info, ["kv_producer", "kv_consumer"], body, wait_for_restarts=True)


def test_a_request_queues_to_one_of_two_suspect_engines(tokenizer_info, monkeypatch):
    """DP=2, both engines suspect: a new request waits on one of them and completes once
    that one speaks again."""
    monkeypatch.setenv("KVSERVE_ENGINE_HEARTBEAT_TIMEOUT_S", str(SHORT_HEARTBEAT_TIMEOUT_S))

    async def body(client, engines):
        for engine in engines:
            await _silence(client, engine)
        _assert_requests_are_taken(client)
        task = asyncio.create_task(_collect(client, "r1"))
        holder = await _engine_that_got(engines, "r1")
        assert not task.done()
        holder.beating = True
        await holder.finish("r1", [65, 66, 67])
        assert (await asyncio.wait_for(task, 5))[-1].outputs[0].token_ids == [65, 66, 67]

    _scenario(tokenizer_info, [None, None], body, wait_for_restarts=True)
