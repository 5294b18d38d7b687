"""A real engine-core process that dies, freezes or fails to start: the api side notices
within seconds (a frozen one: suspect within the heartbeat timeout, hung after the hung
budget) and fails what is in flight with EngineDeadError."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import time

import psutil
import pytest

from kvserve.launch.engines import EngineLaunch, start_engine_process, stop_engine_process
from kvserve.services.api.engine_client.client import EngineDeadError
from kvserve.services.api.engine_client.mp_client import EngineChannel
from kvserve.services.api.serving.tokenizer import TokenizerInfo
from kvserve.shared.config import EngineConfig
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.transport import EngineAddresses
from tests.support.engine import start_engine
from tests.support.waiting import wait_until_async

# Long enough to still be running when the engine is killed after its first tokens.
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer_info(tiny_llama_dir) -> TokenizerInfo:
    return TokenizerInfo(tiny_llama_dir)


async def _first_output_then(client, action, meanwhile=None):
    """Start a long request, run action() after its first output, return (error, seconds)
    from the action until the request failed.

    Args:
        meanwhile: awaited as meanwhile(client, the task draining the request) after the
            action, before the failure is awaited.
    """
    stream = client.generate("victim", None, [1, 2, 3, 4], LONG)
    await asyncio.wait_for(stream.__anext__(), 60)
    action()
    start = time.monotonic()

    async def drain():
        async for _ in stream:
            pass

    task = asyncio.create_task(drain())
    if meanwhile is not None:
        await meanwhile(client, task)
    with pytest.raises(EngineDeadError) as info:
        await asyncio.wait_for(task, 30)  # a missed death would hang here
    return info.value, time.monotonic() - start


def test_kill9_of_the_engine_fails_inflight_requests_within_5s(tiny_llama_dir, tokenizer_info):
    async def main():
        client, process = await start_engine(tiny_llama_dir, tokenizer_info)
        try:
            error, seconds = await _first_output_then(
                client, lambda: os.kill(process.pid, signal.SIGKILL)
            )
            assert seconds < 5, f"noticed after {seconds:.1f} s"
            assert f"EngineCore_0 (pid {process.pid}) died" in str(error)
            assert not client.is_healthy
            with pytest.raises(EngineDeadError):
                await client.get_stats()  # refused at once: nobody would answer
        finally:
            await client.shutdown()
            process.join(10)
        assert process.exitcode == -signal.SIGKILL

    asyncio.run(main())


def test_kill9_of_a_worker_fails_inflight_requests_within_5s(tiny_llama_dir, tokenizer_info):
    async def main():
        client, process = await start_engine(tiny_llama_dir, tokenizer_info, executor="mp")
        try:
            (worker_pid,) = client.handshake.worker_pids
            assert psutil.Process(worker_pid).ppid() == process.pid
            error, seconds = await _first_output_then(
                client, lambda: os.kill(worker_pid, signal.SIGKILL)
            )
            assert seconds < 5, f"noticed after {seconds:.1f} s"
            # Two detectors race, each defined: the api's process watch, or the executor's
            # own check (sent back in the engine's DEAD message). Either names the pid.
            assert re.search(
                rf"worker process \(pid {worker_pid}\) of engine core 0 died"
                rf"|worker rank 0 \(pid {worker_pid}\) died: killed by SIGKILL",
                str(error),
            ), error
            assert not client.is_healthy
        finally:
            await client.shutdown()
            stop_engine_process(process)

    asyncio.run(main())


HEARTBEAT_INTERVAL_S = 0.5  # KVSERVE_ENGINE_HEARTBEAT_INTERVAL_S's default
HUNG_TIMEOUT_S = 6.0


def test_frozen_engine_is_suspect_then_declared_hung(tiny_llama_dir, tokenizer_info, monkeypatch):
    monkeypatch.setenv("KVSERVE_ENGINE_HEARTBEAT_TIMEOUT_S", "2")
    monkeypatch.setenv("KVSERVE_ENGINE_HUNG_TIMEOUT_S", str(HUNG_TIMEOUT_S))

    async def main():
        client, process = await start_engine(tiny_llama_dir, tokenizer_info)
        try:
            # SIGSTOP freezes every thread: the process lives on, its heartbeats stop, and it
            # neither runs nor waits for a CPU.
            error, seconds = await _first_output_then(
                client, lambda: os.kill(process.pid, signal.SIGSTOP), _while_suspect
            )
            # Hung once no progress was seen for the budget: from the last look before the
            # stop at the earliest (the looks come every heartbeat interval).
            assert HUNG_TIMEOUT_S - HEARTBEAT_INTERVAL_S <= seconds < HUNG_TIMEOUT_S + 4
            assert "used no CPU time and waited for none" in str(error)
            assert "KVSERVE_ENGINE_HUNG_TIMEOUT_S): it is hung (stopped or blocked)" in str(error)
            assert not client.is_healthy
        finally:
            await client.shutdown()
            process.kill()
            process.join(10)

    async def _while_suspect(client, drain: asyncio.Task) -> None:
        waited = await wait_until_async(lambda: client.engines[0].is_suspect, timeout_s=5)
        assert waited < 4, f"suspect after {waited:.1f} s"
        assert not drain.done()  # a suspect engine keeps its running request
        (entry,) = client.health_report()["engines"]
        assert entry["state"] == "suspect" and "sent nothing for" in entry["reason"], entry
        assert client.is_healthy  # it may be only slow: the server still takes requests

    asyncio.run(main())


def test_engine_that_fails_to_start_reports_why(tiny_llama_dir, tmp_path):
    bad_dir = str(tmp_path / "bad-model")
    shutil.copytree(tiny_llama_dir, bad_dir)
    config_path = os.path.join(bad_dir, "config.json")
    with open(config_path) as f:
        hf_config = json.load(f)
    hf_config["hidden_act"] = "relu"  # the Llama model refuses it at construction
    with open(config_path, "w") as f:
        json.dump(hf_config, f)

    async def main():
        channel = EngineChannel(EngineAddresses.local())
        process = start_engine_process(
            EngineConfig(), EngineLaunch(model_dir=bad_dir, addresses=channel.addresses)
        )
        try:
            with pytest.raises(EngineDeadError, match="failed to start: ValueError.*relu"):
                await channel.wait_ready(timeout_s=300, engine_process=process)
        finally:
            channel.close()
            process.join(30)
        assert process.exitcode == 1

    asyncio.run(main())
