"""MPEngineClient's liveness rules against a scripted engine peer.

A real engine cannot be made to hang its loop while its IO threads live on, so the test plays
the engine's side of the real wire protocol (real sockets, real codec) and decides what a
busy, hung, silent or dying engine looks like. A silent engine is suspect first, then hung:
on another host after the hung budget of silence; on this host (the READY names a real
child process, stopped or busy) only when that process made no progress for the budget.
Kills and freezes of a real engine are in test_engine_death.py and test_engine_starved.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import zmq
import zmq.asyncio

from kvserve.services.api.engine_client.client import EngineDeadError
from kvserve.services.api.engine_client.mp_client import (
    ClientTopology,
    EngineChannel,
    EngineStalledError,
    MPEngineClient,
)
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
from kvserve.shared.wire import (
    EngineDead,
    EngineHeartbeat,
    EngineReady,
    EngineStats,
    GetStats,
    MsgType,
    Ping,
    UtilityOutput,
    this_hostname,
)
from tests.support.waiting import wait_until_async

HEARTBEAT_INTERVAL_S = 0.1
HEARTBEAT_TIMEOUT_S = 1.0
HUNG_TIMEOUT_S = 3.0
STALL_TIMEOUT_S = 1.0
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
DEFAULT_TOPOLOGY = ClientTopology()  # one engine, no restarts


@pytest.fixture(scope="module")
def tokenizer_info(tiny_llama_dir) -> TokenizerInfo:
    return TokenizerInfo(tiny_llama_dir)


@pytest.fixture(autouse=True)
def fast_liveness(monkeypatch):
    monkeypatch.setenv("KVSERVE_ENGINE_HEARTBEAT_INTERVAL_S", str(HEARTBEAT_INTERVAL_S))
    monkeypatch.setenv("KVSERVE_ENGINE_HEARTBEAT_TIMEOUT_S", str(HEARTBEAT_TIMEOUT_S))
    monkeypatch.setenv("KVSERVE_ENGINE_HUNG_TIMEOUT_S", str(HUNG_TIMEOUT_S))
    monkeypatch.setenv("KVSERVE_ENGINE_STALL_TIMEOUT_S", str(STALL_TIMEOUT_S))


class ScriptedEngine:
    """The engine side of the protocol, driven by the test.

    Heartbeats go out every interval while `beating`; `advancing` makes each one report a new
    busy-loop iteration; `idle` is what the loop claims to be doing. The READY names `pid` on
    `hostname`: another host by default, so only heartbeats can be watched (and
    `worker_pids` there, the workers).
    """

    def __init__(
        self,
        addresses: EngineAddresses,
        pid: int = 1,
        block_size: int = 16,
        hostname: str = "scripted-host",
        engine_index: int = 0,
        kv_role: str | None = None,
        worker_pids: tuple[int, ...] = (),
    ):
        self.pid, self.block_size, self.hostname = pid, block_size, hostname
        self.worker_pids = list(worker_pids)
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
        self.beating, self.advancing, self.idle = True, True, False
        self.num_iterations = 0
        self.heartbeat_task: asyncio.Task | None = None

    async def start(self) -> None:
        handshake = EngineReady(
            engine_index=self.engine_index,
            num_blocks=64,
            max_model_len=128,
            block_size=self.block_size,
            hostname=self.hostname,
            pid=self.pid,
            kv_role=self.kv_role,
            worker_pids=self.worker_pids,
        )
        await self.dealer.send_multipart(self.encoder.encode(MsgType.READY, handshake))
        self.heartbeat_task = asyncio.create_task(self._beat())

    async def _beat(self) -> None:
        while True:
            if self.beating:
                self.num_iterations += self.advancing
                await self.send(
                    MsgType.HEARTBEAT,
                    EngineHeartbeat(
                        self.engine_index, self.num_iterations, self.num_iterations, self.idle, 1
                    ),
                )
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def send(self, msg_type: MsgType, payload) -> None:
        await self.push.send_multipart(self.encoder.encode(msg_type, payload))

    async def recv(self, timeout_s: float = 5.0):
        """The next message from the api that is not one of its heartbeats."""
        async with asyncio.timeout(timeout_s):
            while True:
                msg_type, payload = self.decoder.decode(await self.dealer.recv_multipart())
                if msg_type != MsgType.FRONTEND_HEARTBEAT:
                    return msg_type, payload
                self.num_frontend_heartbeats += 1

    def close(self) -> None:
        if self.heartbeat_task is not None:
            self.heartbeat_task.cancel()
        self.ctx.destroy(linger=0)


async def _connect(
    tokenizer_info, topology: ClientTopology = DEFAULT_TOPOLOGY, **engine_args
) -> tuple[MPEngineClient, ScriptedEngine]:
    channel = EngineChannel(EngineAddresses.local())
    engine = ScriptedEngine(channel.addresses, **engine_args)
    await engine.start()
    client = await MPEngineClient.connect(
        channel, tokenizer_info, "tiny", ready_timeout_s=5, topology=topology
    )
    return client, engine


def _scenario(tokenizer_info, body, topology: ClientTopology = DEFAULT_TOPOLOGY, **engine_args):
    """Run body(client, engine) on a fresh event loop, always closing both ends.

    Args:
        topology: the client's (restarts, --migration-wait-s).
        engine_args: for the ScriptedEngine (a pid and hostname to watch).
    """

    async def main():
        client, engine = await _connect(tokenizer_info, topology, **engine_args)
        try:
            await body(client, engine)
        finally:
            await client.shutdown()
            engine.close()

    asyncio.run(main())


async def _collect(client: MPEngineClient, request_id: str) -> list:
    return [out async for out in client.generate(request_id, None, [1, 2, 3], GREEDY)]


def test_outputs_stream_back_and_utilities_answer(tokenizer_info):
    async def body(client, engine):
        task = asyncio.create_task(_collect(client, "r1"))
        msg_type, request = await engine.recv()
        assert msg_type == MsgType.ADD and request.prompt_token_ids == [1, 2, 3]
        await engine.send(
            MsgType.OUTPUTS, EngineCoreOutputs(outputs=[EngineCoreOutput("r1", [65, 66])])
        )
        await engine.send(
            MsgType.OUTPUTS,
            EngineCoreOutputs(
                outputs=[EngineCoreOutput("r1", [67], finish_reason=FinishReason.LENGTH)]
            ),
        )
        outputs = await asyncio.wait_for(task, 5)
        assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == [65, 66, 67]

        stats = EngineStats(63, 63, 0, 0, 2, 0)
        call = asyncio.create_task(client.get_stats())
        msg_type, utility = await engine.recv()
        assert msg_type == MsgType.UTILITY and isinstance(utility.method, GetStats)
        await engine.send(MsgType.UTILITY_OUTPUT, UtilityOutput(utility.call_id, result=stats))
        assert await asyncio.wait_for(call, 5) == stats

        call = asyncio.create_task(client.ping())
        _, utility = await engine.recv()
        assert isinstance(utility.method, Ping)
        await engine.send(
            MsgType.UTILITY_OUTPUT,
            UtilityOutput(utility.call_id, failure_message="ValueError: nope"),
        )
        with pytest.raises(RuntimeError, match="nope"):
            await asyncio.wait_for(call, 5)
        assert client.is_healthy  # a failed utility is not a dead engine

    _scenario(tokenizer_info, body)


def test_hung_loop_turns_unhealthy_and_recovers(tokenizer_info):
    async def body(client, engine):
        await asyncio.sleep(STALL_TIMEOUT_S * 1.5)  # busy and advancing: healthy
        assert client.is_healthy
        await client.check_health()

        engine.advancing = False  # heartbeats go on, the loop does not move
        waited = await wait_until_async(lambda: not client.is_healthy, STALL_TIMEOUT_S + 2)
        assert waited >= STALL_TIMEOUT_S * 0.5
        assert client.dead_reason is None and "no progress" in client.stall_reason
        with pytest.raises(EngineStalledError):
            await client.check_health()

        engine.advancing = True
        await wait_until_async(lambda: client.is_healthy, 2)

        engine.advancing, engine.idle = False, True  # an idle loop has nothing to advance
        await asyncio.sleep(STALL_TIMEOUT_S * 1.5)
        assert client.is_healthy

    _scenario(tokenizer_info, body)


def _state(client: MPEngineClient) -> tuple[str, str]:
    """Engine 0's /health state and reason ("" when none)."""
    (entry,) = client.health_report()["engines"]
    return entry["state"], entry.get("reason", "")


def test_a_silent_remote_engine_is_suspect_then_hung_and_fails_inflight_requests(
    tokenizer_info,
):
    async def body(client, engine):
        task = asyncio.create_task(_collect(client, "r1"))
        assert (await engine.recv())[0] == MsgType.ADD
        engine.beating = False
        silent_since = time.monotonic()
        waited = await wait_until_async(lambda: client.engines[0].is_suspect, timeout_s=5)
        assert HEARTBEAT_TIMEOUT_S <= waited < HEARTBEAT_TIMEOUT_S + 1
        state, reason = _state(client)
        assert state == "suspect" and "sent nothing for" in reason, reason
        assert "only its silence is known" in reason, reason
        # The only engine is suspect: a new request waits for it rather than fail.
        assert client.is_healthy and client.health_report()["status"] == "degraded"
        queued = asyncio.create_task(_collect(client, "r2"))
        msg_type, request = await engine.recv()
        assert msg_type == MsgType.ADD and request.request_id.startswith("r2")
        assert not task.done()  # it keeps its running request

        # Another host: silence for the whole hung budget is all there is to go by.
        for pending in (task, queued):
            with pytest.raises(EngineDeadError, match=r"sent nothing for .*hung budget 3 s"):
                await asyncio.wait_for(pending, HUNG_TIMEOUT_S + 3)
        assert time.monotonic() - silent_since >= HUNG_TIMEOUT_S
        assert "KVSERVE_ENGINE_HUNG_TIMEOUT_S" in client.engines[0].dead_reason
        assert not client.is_healthy
        with pytest.raises(EngineDeadError):
            await _collect(client, "r3")  # refused at once, never sent

    _scenario(tokenizer_info, body)


def test_a_suspect_engine_serves_again_on_its_next_message(tokenizer_info):
    async def body(client, engine):
        task = asyncio.create_task(_collect(client, "r1"))
        _, request = await engine.recv()
        engine.beating = False
        await wait_until_async(lambda: client.engines[0].is_suspect, timeout_s=5)
        await engine.send(  # a late output is a message like any other
            MsgType.OUTPUTS, EngineCoreOutputs(outputs=[EngineCoreOutput(request.request_id, [65])])
        )
        await wait_until_async(lambda: not client.engines[0].is_suspect, timeout_s=2)
        assert _state(client) == ("serving", "")
        engine.beating = True
        await asyncio.sleep(HUNG_TIMEOUT_S)  # past the hung budget, beating: not hung
        assert client.engines[0].is_alive and not client.engines[0].is_suspect
        await engine.send(
            MsgType.OUTPUTS,
            EngineCoreOutputs(
                outputs=[
                    EngineCoreOutput(request.request_id, [66], finish_reason=FinishReason.LENGTH)
                ]
            ),
        )
        outputs = await asyncio.wait_for(task, 5)
        assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == [65, 66]

    _scenario(tokenizer_info, body)


@contextlib.contextmanager
def _child(code: str) -> Iterator[subprocess.Popen]:
    """A Python child process running `code`, killed on exit."""
    process = subprocess.Popen([sys.executable, "-c", code])
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def test_a_silent_local_engine_whose_process_is_stopped_is_hung(tokenizer_info):
    with _child("while True: pass") as process:

        async def body(client, engine):
            engine.beating = False
            process.send_signal(signal.SIGSTOP)  # neither runs nor waits for a CPU
            silent_since = time.monotonic()
            await wait_until_async(lambda: client.engines[0].is_suspect, timeout_s=5)
            _, reason = _state(client)
            assert "it used no CPU time and waited for none" in reason, reason
            await wait_until_async(lambda: not client.engines[0].is_alive, HUNG_TIMEOUT_S + 3)
            assert time.monotonic() - silent_since >= HUNG_TIMEOUT_S
            reason = client.engines[0].dead_reason
            assert "its process used no CPU time and waited for none" in reason, reason
            assert "it is hung (stopped or blocked)" in reason, reason

        _scenario(tokenizer_info, body, pid=process.pid, hostname=this_hostname())


def test_a_silent_local_engine_whose_process_is_stopped_is_hung_though_its_workers_run(
    tokenizer_info,
):
    # An mp engine core's workers poll their ring and beat whatever the engine core does:
    # their CPU time is no sign that the engine core lives.
    with _child("while True: pass") as process, _child("while True: pass") as worker:

        async def body(client, engine):
            engine.beating = False
            process.send_signal(signal.SIGSTOP)
            silent_since = time.monotonic()
            await wait_until_async(lambda: not client.engines[0].is_alive, HUNG_TIMEOUT_S + 3)
            assert time.monotonic() - silent_since >= HUNG_TIMEOUT_S
            reason = client.engines[0].dead_reason
            assert "its process used no CPU time and waited for none" in reason, reason
            # Killed with its engine core, as a hung engine's workers are.
            assert worker.wait(timeout=5) == -signal.SIGKILL

        _scenario(
            tokenizer_info,
            body,
            pid=process.pid,
            hostname=this_hostname(),
            worker_pids=[worker.pid],
        )


def test_a_silent_local_engine_whose_process_runs_is_never_hung(tokenizer_info):
    with _child("while True: pass") as process:

        async def body(client, engine):
            engine.beating = False  # silent, but its process uses CPU time: slow, not hung
            await wait_until_async(lambda: client.engines[0].is_suspect, timeout_s=5)
            await asyncio.sleep(HUNG_TIMEOUT_S * 1.5)
            assert client.engines[0].is_alive
            state, reason = _state(client)
            assert state == "suspect", reason
            # Running, or waiting for one of this busy host's CPUs: either is a sign of life.
            assert re.search(r"it runs, slowly|it is starved of CPU", reason), reason
            engine.beating = True
            await wait_until_async(lambda: not client.engines[0].is_suspect, timeout_s=2)

        _scenario(tokenizer_info, body, pid=process.pid, hostname=this_hostname())


def test_dead_sentinel_fails_inflight_requests_and_utilities(tokenizer_info):
    async def body(client, engine):
        task = asyncio.create_task(_collect(client, "r1"))
        call = asyncio.create_task(client.reset_prefix_cache())
        assert {(await engine.recv())[0], (await engine.recv())[0]} == {
            MsgType.ADD,
            MsgType.UTILITY,
        }
        await engine.send(MsgType.DEAD, EngineDead(0, "RuntimeError: boom"))
        for pending in (task, call):
            with pytest.raises(EngineDeadError, match="boom"):
                await asyncio.wait_for(pending, 5)
        assert "boom" in await asyncio.wait_for(client.wait_dead(), 1)

    _scenario(tokenizer_info, body)


def test_wait_ready_reports_a_failed_start_and_a_timeout():
    async def main():
        channel = EngineChannel(EngineAddresses.local())
        engine = ScriptedEngine(channel.addresses)
        try:
            await engine.send(MsgType.DEAD, EngineDead(0, "ValueError: no such model"))
            with pytest.raises(EngineDeadError, match="failed to start: ValueError"):
                await channel.wait_ready(timeout_s=5)
            with pytest.raises(EngineDeadError, match="no READY"):
                await channel.wait_ready(timeout_s=0.3)
        finally:
            engine.close()
            channel.close()

    asyncio.run(main())


def test_the_api_beats_to_its_engines(tokenizer_info):
    """Engines that are not the api's children (headless) stop when these stop coming."""

    async def body(client, engine):
        with pytest.raises(TimeoutError):
            await engine.recv(timeout_s=10 * HEARTBEAT_INTERVAL_S)
        assert engine.num_frontend_heartbeats >= 5

    _scenario(tokenizer_info, body)


def test_a_restarted_engine_is_readmitted_in_place_of_its_predecessor(tokenizer_info):
    async def body(client, engine):
        task = asyncio.create_task(_collect(client, "r1"))
        assert (await engine.recv())[0] == MsgType.ADD
        successor = ScriptedEngine(client.channel.addresses, pid=2)
        try:
            await successor.start()  # READY again, from a new process of index 0
            await wait_until_async(lambda: client.engines[0].handshake.pid == 2, timeout_s=5)
            assert client.is_healthy and client.num_readmissions == 1
            # The replaced engine's request moves to its successor, which finishes it.
            msg_type, moved = await successor.recv()
            assert msg_type == MsgType.ADD and moved.request_id.startswith("r1")
            assert moved.resumed_output_token_ids == []
            stats = client.migration_stats()[0]
            assert stats.moves == {"engine_replaced": 1}
            task2 = asyncio.create_task(_collect(client, "r2"))
            msg_type, request = await successor.recv()  # the route is the successor's
            assert msg_type == MsgType.ADD and request.request_id.startswith("r2")
            for request_id in (moved.request_id, request.request_id):
                await successor.send(
                    MsgType.OUTPUTS,
                    EngineCoreOutputs(
                        outputs=[
                            EngineCoreOutput(request_id, [65], finish_reason=FinishReason.LENGTH)
                        ]
                    ),
                )
            for finished in (task, task2):
                outputs = await asyncio.wait_for(finished, 5)
                assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == [65]
        finally:
            successor.close()

    _scenario(tokenizer_info, body)


def test_a_ready_that_does_not_fit_is_refused(tokenizer_info):
    async def body(client, engine):
        stranger = ScriptedEngine(client.channel.addresses, pid=3, block_size=32)
        try:
            await stranger.start()
            # It took the identity's route, so the engine it tried to replace is unreachable
            # and dropped, naming why; the stranger is never admitted.
            await wait_until_async(lambda: not client.engines[0].is_alive, timeout_s=5)
            reason = client.engines[0].dead_reason
            assert "was refused (pid 3" in reason and "block size 32" in reason, reason
            assert client.engines[0].handshake.pid == 1 and client.num_readmissions == 0
            with pytest.raises(TimeoutError):
                await stranger.recv(timeout_s=5 * HEARTBEAT_INTERVAL_S)
            assert stranger.num_frontend_heartbeats == 0
        finally:
            stranger.close()

    _scenario(tokenizer_info, body)


HELD_WAIT_S = 1.0  # --migration-wait-s of the clients that wait for restarts


def test_a_request_sent_while_the_last_engine_is_dead_waits_for_its_restart(tokenizer_info):
    async def body(client, engine):
        await engine.send(MsgType.DEAD, EngineDead(0, "RuntimeError: boom"))
        await wait_until_async(lambda: not client.engines[0].is_alive, timeout_s=5)
        assert client.waits_for_engine and not client.is_healthy and client.dead_reason is None
        task = asyncio.create_task(_collect(client, "held"))
        await asyncio.sleep(HELD_WAIT_S / 2)  # held meanwhile, neither failed nor sent
        assert not task.done()
        successor = ScriptedEngine(client.channel.addresses, pid=2)
        try:
            await successor.start()
            msg_type, request = await successor.recv()
            assert msg_type == MsgType.ADD and request.request_id.startswith("held")
            assert not client.waits_for_engine
            output = EngineCoreOutput(request.request_id, [65], finish_reason=FinishReason.LENGTH)
            await successor.send(MsgType.OUTPUTS, EngineCoreOutputs(outputs=[output]))
            outputs = await asyncio.wait_for(task, 5)
            assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == [65]
        finally:
            successor.close()

    topology = ClientTopology(wait_for_restarts=True, migration_wait_s=10 * HELD_WAIT_S)
    _scenario(tokenizer_info, body, topology)


def test_a_held_request_fails_once_no_engine_came_back_in_time(tokenizer_info):
    async def body(client, engine):
        await engine.send(MsgType.DEAD, EngineDead(0, "RuntimeError: boom"))
        await wait_until_async(lambda: not client.engines[0].is_alive, timeout_s=5)
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"within 1 s \(--migration-wait-s\)"):
            await asyncio.wait_for(_collect(client, "held"), 5)
        assert time.monotonic() - started >= HELD_WAIT_S
        assert client.dead_reason is None and not client.queues  # nothing left behind

    topology = ClientTopology(wait_for_restarts=True, migration_wait_s=HELD_WAIT_S)
    _scenario(tokenizer_info, body, topology)


def test_without_restarts_a_request_after_the_last_death_fails_at_once(tokenizer_info):
    async def body(client, engine):
        await engine.send(MsgType.DEAD, EngineDead(0, "RuntimeError: boom"))
        await asyncio.wait_for(client.wait_dead(), 5)
        assert not client.waits_for_engine
        with pytest.raises(EngineDeadError, match="boom"):
            await asyncio.wait_for(_collect(client, "refused"), 1)

    _scenario(tokenizer_info, body)


def test_a_pd_prefill_whose_lone_engine_dies_is_held_then_fails_in_time(tokenizer_info):
    """P/D: the prefill copy's engine (the only kv_producer) dies with it; the request is
    held for a restarted prefill engine, and without one fails after --migration-wait-s
    with the prefill's death in the reason; the decode engine never gets it."""

    async def main():
        channel = EngineChannel(EngineAddresses.local())
        prefill = ScriptedEngine(channel.addresses, pid=1, kv_role="kv_producer")
        decode = ScriptedEngine(channel.addresses, pid=2, engine_index=1, kv_role="kv_consumer")
        await prefill.start()
        await decode.start()
        topology = ClientTopology(
            num_engines=2, wait_for_restarts=True, migration_wait_s=HELD_WAIT_S
        )
        client = await MPEngineClient.connect(
            channel, tokenizer_info, "tiny", ready_timeout_s=5, topology=topology
        )
        try:
            task = asyncio.create_task(_collect(client, "pd"))
            msg_type, copy = await prefill.recv()
            assert msg_type == MsgType.ADD and copy.request_id.endswith("-prefill")
            await prefill.send(MsgType.DEAD, EngineDead(0, "RuntimeError: prefill boom"))
            await wait_until_async(lambda: client.waits_for_engine, timeout_s=5)
            assert client.flow.lost_stage() == "prefill" and not task.done()
            with pytest.raises(EngineDeadError, match=r"within 1 s .*prefill boom"):
                await asyncio.wait_for(task, 5)
            assert client.dead_reason is None and not client.queues
            with pytest.raises(TimeoutError):
                await decode.recv(timeout_s=0.2)  # the decode was never sent
        finally:
            await client.shutdown()
            prefill.close()
            decode.close()

    asyncio.run(main())
