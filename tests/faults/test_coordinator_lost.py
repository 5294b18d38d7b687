"""A hung DP coordinator does not stop serving (services/api/engine_client/load_tables.py).

A SIGKILLed coordinator is restarted by the launcher (test_faults_supervision.py); a
SIGSTOPped one is not, and sends no more load tables. The api must then route on its own
counts, say so in its log and in /health, and go back to the tables once they come again.
One real `kvserve serve` with two engine cores of the tiny random Llama, real HTTP through
the official openai client; every step waits for the server's own state (its log lines,
/health, /metrics).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import signal
from collections.abc import Iterator

import openai
import pytest

from tests.support.server import DP_MODEL_NAME, ServeProcess, start_tiny_server
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

LOST_LINE = "no load table from the DP coordinator"
BACK_LINE = "the DP coordinator's load tables are back"


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory) -> Iterator[ServeProcess]:
    server = start_tiny_server(
        tiny_llama_dir,
        tmp_path_factory.mktemp("coordinator-lost"),
        "--data-parallel-size",
        "2",
        # An engine core the test pauses stays "serving" (not suspect, which would route
        # around it whatever the load view says) for the test's length.
        env={"KVSERVE_ENGINE_HEARTBEAT_TIMEOUT_S": "60", "KVSERVE_ENGINE_HUNG_TIMEOUT_S": "120"},
    )
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def _complete(
    server: ServeProcess, prompt: str, max_tokens: int, stream: bool = False, timeout_s=120
) -> str:
    client = openai.OpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=timeout_s
    )
    kwargs = dict(
        model=DP_MODEL_NAME,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    if not stream:
        return client.completions.create(**kwargs).choices[0].text
    chunks = client.completions.create(stream=True, **kwargs)
    return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)


def _engine_holding_one(server: ServeProcess) -> dict:
    """The /health entry of the engine core the api sent the one request in flight to."""
    found: dict = {}

    def sent() -> bool:
        holding = [e for e in server.health()[1]["engines"] if e["num_in_flight"] == 1]
        found.update(holding[0] if holding else {})
        return bool(holding)

    assert wait_until(sent, timeout_s=30, interval_s=0.01), server.health()
    return found


def test_a_hung_coordinator_leaves_routing_to_the_api_own_counts(server):
    (pid,) = map(int, re.findall(r"started DP coordinator process \(pid (\d+)\)", server.log()))
    os.kill(pid, signal.SIGSTOP)
    try:
        assert wait_until(lambda: LOST_LINE in server.log(), timeout_s=30), server.log()
        status, body = server.health()
        assert status == 200 and body["coordinator"]["state"] == "lost", body

        pids = [e["pid"] for e in server.health()[1]["engines"]]
        for engine_pid in pids:  # paused, an engine holds the long request as long as needed
            os.kill(engine_pid, signal.SIGSTOP)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            long = pool.submit(_complete, server, "a long one", 480, True)
            busy = _engine_holding_one(server)
            for engine_pid in pids:
                if engine_pid != busy["pid"]:
                    os.kill(engine_pid, signal.SIGCONT)
            try:
                # The api's own counts: the paused engine holds one request, the other
                # none, so each short request goes to the other (one sent to the paused
                # engine would time out). The last table, frozen, would count each short
                # request until the next table and send every other one there.
                for i in range(4):
                    _complete(server, f"short {i}", 2, timeout_s=15)
                engines = {e["engine"]: e for e in server.health()[1]["engines"]}
                assert engines[busy["engine"]]["num_in_flight"] == 1, engines
                assert engines[busy["engine"]]["state"] == "serving", engines  # not suspect
            finally:
                for engine_pid in pids:
                    os.kill(engine_pid, signal.SIGCONT)
            long.result(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)

    assert wait_until(lambda: BACK_LINE in server.log(), timeout_s=30), server.log()
    status, body = server.health()
    assert status == 200 and body["coordinator"]["state"] == "serving", body
    assert body["status"] == "healthy", body
    assert server.log().count(LOST_LINE) == 1  # one line per event, not one per table missed
