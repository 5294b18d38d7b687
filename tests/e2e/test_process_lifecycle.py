"""The multi-process server end to end: a real engine-core process behind MPEngineClient, and
`kvserve serve` as a user runs it (real HTTP, SIGTERM, kill -9, no orphans)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading

import httpx
import msgspec
import psutil
import pytest

from kvserve.launch.engines import stop_engine_process
from kvserve.services.api.serving.tokenizer import TokenizerInfo
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.wire import MsgType
from tests.support.engine import start_engine
from tests.support.models import TINY_KV_CACHE_MEMORY
from tests.support.ports import free_port
from tests.support.processes import engine_child, wait_gone
from tests.support.server import (
    health_status,
    read_log,
    start_kvserve,
    start_serve,
    stream_completion,
    wait_healthy,
)
from tests.support.waiting import wait_until

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
PROMPT_IDS = [72, 101, 108, 108, 111]


def test_api_process_does_not_import_torch():
    code = (
        "import sys, kvserve.services.api.engine_client.mp_client, kvserve.launch.serve, "
        "kvserve.cli; "
        "kvserve.cli.build_parser(); assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_engine_process_streams_aborts_and_stops_cleanly(tiny_llama_dir):
    async def main():
        client, process = await start_engine(tiny_llama_dir, TokenizerInfo(tiny_llama_dir))
        try:
            assert client.handshake.max_model_len == 512
            assert client.handshake.pid == process.pid
            stats = await client.get_stats()
            assert stats.num_free_blocks == stats.num_blocks > 0

            # Streamed: one output per step, tokens accumulate, the last one finishes.
            outputs = [o async for o in client.generate("a", None, PROMPT_IDS, GREEDY)]
            assert len(outputs) == GREEDY.max_tokens
            assert [len(o.outputs[0].token_ids) for o in outputs] == list(range(1, 9))
            assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"
            # Greedy is deterministic across requests (and the prefix cache hit).
            again = [o async for o in client.generate("b", None, PROMPT_IDS, GREEDY)]
            assert again[-1].outputs[0].token_ids == outputs[-1].outputs[0].token_ids

            # Abort mid-way: the blocks come back.
            stream = client.generate("c", None, PROMPT_IDS, LONG)
            for _ in range(3):
                await stream.__anext__()
            stats = await client.get_stats()
            assert stats.num_running_reqs == 1 and stats.num_free_blocks < stats.num_blocks
            await stream.aclose()  # a client that went away: aborts in the engine
            stats = await client.get_stats()
            assert stats.num_running_reqs == stats.num_waiting_reqs == 0
            assert stats.num_free_blocks == stats.num_blocks

            # A message the engine cannot decode is dropped: never an engine crash.
            await client.channel.input_socket.send_multipart(
                [client.identity, MsgType.ADD.frame, msgspec.msgpack.encode(["x", "no ids"])]
            )
            assert (await client.get_stats()).num_running_reqs == 0

            assert await client.reset_prefix_cache() is True
            heartbeat = await client.ping()
            assert heartbeat.num_steps >= 2 * GREEDY.max_tokens and not heartbeat.idle
            assert client.is_healthy
        finally:
            await client.shutdown()
            stop_engine_process(process)
        assert process.exitcode == 0  # SIGTERM: a clean exit, not a kill

    asyncio.run(main())


def _start_stream(port: int, max_tokens: int) -> tuple[threading.Thread, list]:
    """A streamed completion in a thread, once its first chunk arrived; (thread, events of
    stream_completion)."""
    body = {"prompt": "Hello", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    events, first_data = [], threading.Event()
    client = threading.Thread(
        target=stream_completion, args=(f"http://127.0.0.1:{port}", body, events, first_data)
    )
    client.start()
    assert first_data.wait(60)
    return client, events


@pytest.mark.slow
def test_serve_sigterm_drains_inflight_and_leaves_no_orphans(tiny_llama_dir, tmp_path):
    port, log_path = free_port(), str(tmp_path / "serve.log")
    server = start_serve(tiny_llama_dir, port, log_path)
    try:
        wait_healthy(server, port, log_path)
        descendants = psutil.Process(server.pid).children(recursive=True)
        assert descendants, "no engine process"
        client, events = _start_stream(port, 100)

        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=150) == 0, read_log(log_path)
        client.join(timeout=30)
        # The request in flight at SIGTERM ran to its end.
        chunks = [item for _, item in events]
        assert chunks[0] == 200 and chunks[-1] == "[DONE]", (chunks[-2:], read_log(log_path))
        assert json.loads(chunks[-2])["choices"][0]["finish_reason"] == "length"
        assert not wait_gone(descendants, timeout_s=10), read_log(log_path)
    finally:
        if server.poll() is None:
            server.kill()


@pytest.mark.slow
def test_serve_exits_nonzero_naming_a_killed_engine(tiny_llama_dir, tmp_path):
    port, log_path = free_port(), str(tmp_path / "serve.log")
    server = start_serve(tiny_llama_dir, port, log_path)
    try:
        wait_healthy(server, port, log_path)
        engine = engine_child(server)
        descendants = psutil.Process(server.pid).children(recursive=True)
        client, events = _start_stream(port, 400)

        engine.kill()
        assert wait_until(lambda: health_status(port) != 200, timeout_s=5, interval_s=0.1), (
            "/health still 200 5 s after kill -9"
        )
        client.join(timeout=30)
        assert not any(
            isinstance(c, str) and '"finish_reason":"length"' in c.replace(" ", "")
            for _, c in events
        ), "the stream finished normally after the kill"
        assert server.wait(timeout=30) == 1
        log = read_log(log_path)
        assert f"EngineCore_0 (pid {engine.pid}) died" in log, log
        assert not wait_gone(descendants, timeout_s=10)
    finally:
        if server.poll() is None:
            server.kill()


@pytest.mark.slow
def test_api_and_engine_started_apart_talk_over_tcp(tiny_llama_dir, tmp_path):
    """`kvserve api` + `kvserve engine`, as compose runs them; the api exits 1 when its
    engine dies."""
    port, input_port, output_port = free_port(), free_port(), free_port()
    addrs = [
        "--input-addr",
        f"tcp://127.0.0.1:{input_port}",
        "--output-addr",
        f"tcp://127.0.0.1:{output_port}",
    ]
    api_log = str(tmp_path / "api.log")
    api = start_kvserve(
        ["api", tiny_llama_dir, "--host", "127.0.0.1", "--port", str(port), *addrs], api_log
    )
    engine = start_kvserve(
        ["engine", tiny_llama_dir, "--kv-cache-memory", str(TINY_KV_CACHE_MEMORY), *addrs],
        str(tmp_path / "engine.log"),
    )
    try:
        wait_healthy(api, port, api_log)
        body = {"prompt": "Hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200
        assert response.json()["choices"][0]["finish_reason"] == "length"

        engine.send_signal(signal.SIGKILL)
        assert api.wait(timeout=30) == 1
        assert f"(pid {engine.pid}) died" in read_log(api_log)
    finally:
        for process in (api, engine):
            if process.poll() is None:
                process.kill()
