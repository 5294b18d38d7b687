"""Data parallelism end to end: `kvserve serve --data-parallel-size 2` as a user runs it.

Real processes (api, DP coordinator, two engine cores), real HTTP, the official openai
client. Engine placement is read from the per-engine series of /metrics (`engine="0"`), and
from /health's JSON body.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import psutil
import pytest

from tests.faults.harness import KV_CACHE_MEMORY, free_port, wait_healthy
from tests.faults.tiny_model import build_tiny_llama

pytestmark = pytest.mark.slow

MODEL_NAME = "tiny-dp"
NUM_ENGINES = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


class ServeProcess:
    """`kvserve serve ...` in its own session, so cleanup reaches every descendant.

    Args:
        args: the flags after `kvserve serve`.
        log_path: where its stdout and stderr go.
        port: its HTTP port (None: a headless node).
    """

    def __init__(self, args: list[str], log_path: str, port: int | None):
        self.port, self.log_path = port, log_path
        env = {**os.environ, "KVSERVE_ENGINE_HEARTBEAT_TIMEOUT_S": "3"}
        env.pop("OMP_NUM_THREADS", None)  # let the launcher split the cores among engines
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kvserve.cli", "serve", *args], stdout=log,
                stderr=subprocess.STDOUT, env=env, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def health(self) -> tuple[int, dict]:
        response = httpx.get(self.url + "/health", timeout=5)
        return response.status_code, response.json()

    def metric(self, name: str, engine: int) -> float:
        """A per-engine sample of /metrics (0 when absent)."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith(name + "{") and f'engine="{engine}"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL the whole session if it lingers; the exit code of SIGTERM."""
        descendants = []
        try:
            descendants = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
        exit_code = None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                exit_code = self.process.wait(timeout=40)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        _, alive = psutil.wait_procs(descendants, timeout=10)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
        return exit_code


def start_front_end(model_dir: str, tmp_path, *extra: str) -> ServeProcess:
    port = free_port()
    return ServeProcess([model_dir, "--host", "127.0.0.1", "--port", str(port),
                         "--kv-cache-memory", str(KV_CACHE_MEMORY), "--served-model-name",
                         MODEL_NAME, "--uvicorn-log-level", "warning",
                         "--data-parallel-size", str(NUM_ENGINES), *extra],
                        str(tmp_path / f"serve-{port}.log"), port)


def complete(server: ServeProcess, prompt: str, max_tokens: int = 6) -> str:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=60)
    response = client.completions.create(model=MODEL_NAME, prompt=prompt,
                                         max_tokens=max_tokens, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert response.choices[0].finish_reason == "length"
    return response.choices[0].text


@pytest.fixture(scope="module")
def load_server(model_dir, tmp_path_factory):
    server = start_front_end(model_dir, tmp_path_factory.mktemp("dp-load"))
    try:
        wait_healthy(server.process, server.port, server.log_path)
        yield server
    finally:
        server.stop()


def test_concurrent_requests_are_served_by_both_engines(load_server):
    status, body = load_server.health()
    assert status == 200 and body["status"] == "healthy", body
    assert [e["engine"] for e in body["engines"]] == list(range(NUM_ENGINES))
    assert all(e["state"] == "serving" for e in body["engines"]), body
    # The engines are the launcher's children (so are the coordinator and multiprocessing's
    # resource tracker).
    children = psutil.Process(load_server.process.pid).children()
    assert {e["pid"] for e in body["engines"]} <= {child.pid for child in children}
    assert "engine core uses 1 torch threads" in load_server.log()  # 2 cores, 2 engines

    prompts = [f"request {i}: tell me a story about the number {i}" for i in range(40)]
    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        texts = list(pool.map(lambda p: complete(load_server, p), prompts))
    assert len(texts) == 40 and all(texts)
    queried = [load_server.metric("kvserve:prefix_cache_queries_total", i)
               for i in range(NUM_ENGINES)]
    assert all(q > 0 for q in queried), queried
    # Both took a real share: neither got fewer than a quarter of the prompt tokens.
    assert min(queried) > sum(queried) / 4, queried
    assert all(load_server.metric("kvserve:engine_up", i) == 1 for i in range(NUM_ENGINES))


def _stream(server: ServeProcess, max_tokens: int, events: list) -> None:
    """Stream a completion; events gets the status, then each SSE data line (or the error
    body), each as (time.monotonic(), text)."""
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          timeout=60) as response:
            events.append((time.monotonic(), response.status_code))
            if response.status_code != 200:
                events.append((time.monotonic(), response.read().decode()))
                return
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append((time.monotonic(), line.removeprefix("data: ")))
    except httpx.HTTPError as exc:
        events.append((time.monotonic(), repr(exc)))


def test_a_killed_engine_is_dropped_and_the_other_serves_on(load_server):
    _, body = load_server.health()
    victim = body["engines"][1]
    # Frozen first, so its request is surely in flight there when it dies (the tiny model
    # would finish a whole stream in well under a second).
    os.kill(victim["pid"], signal.SIGSTOP)
    # Streams until one sits on the frozen engine (ties between idle engines go
    # round-robin, so the second one at the latest); the others run on engine 0.
    streams = []
    for _ in range(6):
        events = []
        thread = threading.Thread(target=_stream, args=(load_server, 100, events))
        thread.start()
        streams.append((thread, events))
        thread.join(timeout=2)
        if thread.is_alive():
            break
    assert len(streams) <= 2, "no request went to the frozen engine"
    os.kill(victim["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    for thread, _ in streams:
        thread.join(timeout=30)
        assert not thread.is_alive(), "a stream hung after the engine was killed"

    errors = [[(t, e) for t, e in events if '"error"' in str(e)] for _, events in streams]
    assert [len(e) for e in errors] == [0] * (len(streams) - 1) + [1], streams
    for _, healthy_events in streams[:-1]:
        assert healthy_events[-1][1] == "[DONE]"
        assert json.loads(healthy_events[-2][1])["choices"][0]["finish_reason"] == "length"
    failed_events = streams[-1][1]
    error_time, error_body = errors[-1][0]
    assert error_time - killed_at < 5, "the killed engine's request failed too slowly"
    error = json.loads(error_body)["error"]
    assert f"EngineCore_1 (pid {victim['pid']}) died" in error["message"], error
    assert error["code"] == 503 or failed_events[0][1] == 503, failed_events

    status, body = load_server.health()
    assert status == 200 and body["status"] == "degraded", body
    assert [e["state"] for e in body["engines"]] == ["serving", "dead"], body
    assert "EngineCore_1" in body["engines"][1]["reason"]
    assert load_server.metric("kvserve:engine_up", 1) == 0
    before = load_server.metric("kvserve:prefix_cache_queries_total", 0)
    for i in range(4):
        assert complete(load_server, f"after the kill {i}")
    assert load_server.metric("kvserve:prefix_cache_queries_total", 0) > before
    assert load_server.process.poll() is None
    assert load_server.stop() == 0, load_server.log()


PREFIX_LEN = 256  # tokens: the tiny model's tokenizer is one token per byte
NUM_GROUPS = 3


def _group_prefix(group: int) -> str:
    text = f"group {group} shared system prompt. " * 20
    return text[:PREFIX_LEN]


def test_prefix_routing_sends_a_prefix_to_the_engine_that_cached_it(model_dir, tmp_path):
    server = start_front_end(model_dir, tmp_path, "--dp-routing", "prefix")
    try:
        wait_healthy(server.process, server.port, server.log_path)

        def totals() -> list[tuple[float, float]]:
            return [(server.metric("kvserve:prefix_cache_queries_total", i),
                     server.metric("kvserve:prefix_cache_hits_total", i))
                    for i in range(NUM_ENGINES)]

        def send(group: int, index: int) -> tuple[int, float]:
            """(the engine that served it, its prefix-cache hit tokens)."""
            before = totals()
            complete(server, _group_prefix(group) + f" question {index} of {group}?", 4)
            after = totals()
            (engine,) = [i for i in range(NUM_ENGINES) if after[i][0] > before[i][0]]
            return engine, after[engine][1] - before[engine][1]

        homes = {}
        for group in range(NUM_GROUPS):  # the first of each group computes its prefix
            homes[group], hits = send(group, 0)
            assert hits == 0
        assert len(set(homes.values())) == NUM_ENGINES  # spread by load
        for index in range(1, 4):
            for group in range(NUM_GROUPS):
                engine, hits = send(group, index)
                assert engine == homes[group], (group, index, homes)
                assert hits >= PREFIX_LEN - 16, hits  # every full block of the prefix
    finally:
        server.stop()
