"""A real engine-core process that dies, freezes or fails to start: the api side notices
within seconds and fails what is in flight with EngineDeadError."""

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
from kvserve.services.api.engine_client import EngineDeadError
from kvserve.services.api.mp_client import EngineChannel
from kvserve.services.api.tokenizer import TokenizerInfo
from kvserve.shared.config import EngineConfig
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.transport import EngineAddresses
from tests.support.engine import start_engine

# Long enough to still be running when the engine is killed after its first tokens.
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer_info(tiny_llama_dir) -> TokenizerInfo:
    return TokenizerInfo(tiny_llama_dir)


async def _first_output_then(client, action):
    """Start a long request, run action() after its first output, return (error, seconds)
    from the action until the request failed."""
    stream = client.generate("victim", None, [1, 2, 3, 4], LONG)
    await asyncio.wait_for(stream.__anext__(), 60)
    action()
    start = time.monotonic()

    async def drain():
        async for _ in stream:
            pass

    with pytest.raises(EngineDeadError) as info:
        await asyncio.wait_for(drain(), 30)  # a missed death would hang here
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


def test_frozen_engine_is_declared_dead(tiny_llama_dir, tokenizer_info, monkeypatch):
    monkeypatch.setenv("KVSERVE_ENGINE_HEARTBEAT_TIMEOUT_S", "2")

    async def main():
        client, process = await start_engine(tiny_llama_dir, tokenizer_info)
        try:
            # SIGSTOP freezes every thread: the process lives on, its heartbeats stop.
            error, seconds = await _first_output_then(
                client, lambda: os.kill(process.pid, signal.SIGSTOP)
            )
            assert seconds < 5
            assert "sent nothing" in str(error)
        finally:
            await client.shutdown()
            process.kill()
            process.join(10)

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
