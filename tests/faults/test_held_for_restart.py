"""A request that reaches the api while its only engine core is dead and restarting is held
for the restart and served by the restarted engine, not refused (MPEngineClient._submit).

One real `kvserve serve` of the tiny random Llama with --restart-dead-engines, real HTTP
through the official openai client, a real SIGKILL. The restarted engine process is
SIGSTOPped as soon as it exists (long before it can say READY), so the requests surely
arrive while no engine serves; each step waits for the api's own log line that says the
request is held, never for a wall-clock delay.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
from collections.abc import Iterator

import openai
import psutil
import pytest

from tests.support.server import DP_MODEL_NAME, ServeProcess, start_tiny_server
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

# How long a held request waits for the restart (--migration-wait-s): far longer than the
# restart takes. The 503 after it is tested against a scripted engine (test_engine_liveness).
MIGRATION_WAIT_S = 90
PROMPT = "held for the restart: once upon a time"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory) -> Iterator[ServeProcess]:
    server = start_tiny_server(
        tiny_llama_dir,
        tmp_path_factory.mktemp("held-for-restart"),
        "--restart-dead-engines",
        "--migration-wait-s",
        str(MIGRATION_WAIT_S),
    )
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def _client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _complete(server: ServeProcess, stream: bool) -> str:
    """A greedy completion of PROMPT (streamed or not); its text."""
    kwargs = dict(
        model=DP_MODEL_NAME,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    if not stream:
        return _client(server).completions.create(**kwargs).choices[0].text
    chunks = _client(server).completions.create(stream=True, **kwargs)
    return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)


def _kill_engine_and_freeze_its_restart(server: ServeProcess) -> psutil.Process:
    """SIGKILL the engine core, SIGSTOP its restarted process the moment the launcher
    spawns it, and return that process once /health reports no engine serving."""
    serve = psutil.Process(server.process.pid)
    before = {child.pid for child in serve.children()}
    (engine,) = server.health()[1]["engines"]
    os.kill(engine["pid"], signal.SIGKILL)
    spawned: list[psutil.Process] = []

    def restarted() -> bool:
        spawned.extend(c for c in serve.children() if c.pid not in before | {engine["pid"]})
        return bool(spawned)

    assert wait_until(restarted, timeout_s=30, interval_s=0.005), "the engine was not restarted"
    for process in spawned:
        process.send_signal(signal.SIGSTOP)
    assert wait_until(lambda: server.health()[1]["engines"][0]["state"] == "dead", timeout_s=30)
    return spawned[0]


def _num_held(server: ServeProcess) -> int:
    return server.log().count("is held for a restarted engine core")


def test_requests_sent_while_the_engine_restarts_wait_for_it(server):
    reference = _complete(server, stream=False)
    assert _complete(server, stream=True) == reference
    restarted = _kill_engine_and_freeze_its_restart(server)
    try:
        # Sent while no engine lives: both are held (the api says so), then served by the
        # restarted engine, greedy-equal to the undisturbed run.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            texts = [pool.submit(_complete, server, stream) for stream in (False, True)]
            assert wait_until(lambda: _num_held(server) == 2, timeout_s=30), server.log()
            assert server.health()[0] == 503  # held, not served: no engine lives yet
            restarted.send_signal(signal.SIGCONT)
            assert [text.result(timeout=90) for text in texts] == [reference, reference]
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            restarted.send_signal(signal.SIGCONT)
    assert server.log().count("held for it") == 2
    assert server.health()[1]["status"] == "healthy"
    assert _complete(server, stream=False) == reference
