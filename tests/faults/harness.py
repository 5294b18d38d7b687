"""Start real engine-core processes and `kvserve serve` launchers for the process tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import psutil

from kvserve.shared.config import CacheConfig, EngineConfig, ParallelConfig
from kvserve.shared.transport import EngineAddresses
from kvserve.services.api.mp_client import EngineChannel, MPEngineClient
from kvserve.services.api.tokenizer import TokenizerInfo
from kvserve.serve import start_engine_process

# The tiny model's KV cache: plenty of blocks, little memory.
KV_CACHE_MEMORY = 16 << 20
ENGINE_READY_TIMEOUT_S = 300  # torch import + model load on a loaded 2-core machine


async def start_engine(model_dir: str, tokenizer_info: TokenizerInfo, executor: str = "uni"
                       ) -> tuple[MPEngineClient, object]:
    """A real engine-core process (spawned as `kvserve serve` does) and its connected client."""
    config = EngineConfig(cache=CacheConfig(kv_cache_memory=KV_CACHE_MEMORY),
                          parallel=ParallelConfig(distributed_executor_backend=executor))
    channel = EngineChannel(EngineAddresses.local())
    process = start_engine_process(config, model_dir, channel.addresses)
    try:
        client = await MPEngineClient.connect(channel, tokenizer_info, "tiny", process,
                                              ready_timeout_s=ENGINE_READY_TIMEOUT_S)
    except BaseException:
        channel.close()
        process.kill()
        process.join()
        raise
    return client, process


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_serve(model_dir: str, port: int, log_path: str) -> subprocess.Popen:
    """`kvserve serve MODEL` as a user runs it, its log (stdout + stderr) in log_path."""
    # A generous drain: a loaded 2-core machine may need long for one request's tokens.
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", model_dir, "--host", "127.0.0.1",
           "--port", str(port), "--kv-cache-memory", str(KV_CACHE_MEMORY),
           "--shutdown-timeout", "120"]
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "KVSERVE_ENGINE_HEARTBEAT_TIMEOUT_S": "3"})


def wait_healthy(process: subprocess.Popen, port: int, log_path: str,
                 timeout_s: float = ENGINE_READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"kvserve serve exited early:\n{open(log_path).read()}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"kvserve serve not healthy in {timeout_s} s:\n{open(log_path).read()}")


@contextlib.contextmanager
def serving(serve_args: list[str], log_path: str) -> Iterator[str]:
    """`kvserve serve --host 127.0.0.1 --port P *serve_args`, healthy; yields its base URL and
    stops it (SIGTERM, then SIGKILL after a minute) on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), *serve_args]
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ)
    try:
        wait_healthy(process, port, log_path)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def engine_child(process: subprocess.Popen) -> psutil.Process:
    """The launcher's engine-core child (spawned: its command line runs spawn_main)."""
    (engine,) = [child for child in psutil.Process(process.pid).children()
                 if "spawn_main" in " ".join(child.cmdline())]
    return engine


def wait_gone(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """The processes still alive (zombies count as gone) after up to timeout_s."""
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
