"""The KV store's death mid-transfer costs no P/D request: the decode engine computes what it
cannot load, and the client sees the completion an undisturbed run gives, token for token.

One real `kvserve serve --prefill-size 1 --decode-size 1` of the tiny random Llama with its
KV store, real HTTP through the official openai client, real SIGKILLs of the store (which
the launcher restarts, empty). Each kill point comes from the api's own count of the
requests each engine holds (/health), with the engine on the far side of the transfer
paused, never from a wall-clock delay:
  - the KV in the store, between the prefill and the decode: the decode engine is paused,
    the prefill done, the request sent to it; the store dies; the decode engine resumes;
  - the KV on its way into the store: the prefill engine is paused with the prefill copy
    sent to it; the store dies; the prefill engine resumes and saves into nothing.

The same server (--restart-dead-engines, the `mp` executor) also loses its engines:
  - the lone prefill engine, SIGKILLed (paused first) once the api has sent it a prefill
    copy: the request is held for the restarted prefill engine and completes, greedy-equal;
  - an engine core, SIGKILLed: once /health shows its restart, the shared-memory ring it
    created for its worker is gone from /dev/shm (the launcher unlinked it).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import glob
import os
import re
import signal
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.support.server import ServeProcess, start_tiny_server
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

# Several full blocks of prompt (the tiny model's blocks hold 16 tokens): what moves.
PROMPT = "the store dies mid-transfer: " + "once upon a time " * 12
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory) -> Iterator[ServeProcess]:
    server = start_tiny_server(
        tiny_llama_dir,
        tmp_path_factory.mktemp("pd-store-death"),
        "--prefill-size",
        "1",
        "--decode-size",
        "1",
        "--kv-store-size",
        "64M",
        "--restart-dead-engines",
        "--migration-wait-s",
        "60",
        "--distributed-executor-backend",
        "mp",
        # A paused engine stays "serving", not suspect, however late (a loaded machine) the
        # request sent to it arrives: these tests are about the store and deaths, not silence
        # (a lone suspect engine of a stage still takes requests: test_pd_routing.py).
        env={"KVSERVE_ENGINE_HEARTBEAT_TIMEOUT_S": "20"},
    )
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()
    # Every killed engine's ring and store's arenas were unlinked and unregistered by whoever
    # restarted it: the resource tracker finds nothing left at the launcher's exit.
    assert "leaked shared_memory" not in server.log(), server.log()


def _store_pids(server: ServeProcess) -> list[int]:
    return [int(pid) for pid in re.findall(r"KV store process KvStore \(pid (\d+)\)", server.log())]


def _engine(server: ServeProcess, kv_role: str) -> dict:
    (engine,) = [e for e in server.health()[1]["engines"] if e.get("kv_role") == kv_role]
    return engine


def _forget_cached_prefixes(server: ServeProcess) -> None:
    """Engines forget their own prefixes: the prompt's KV must move through the store."""
    assert httpx.post(server.url + "/reset_prefix_cache", timeout=30).status_code == 200


def _complete_with_store_killed(
    server: ServeProcess, paused_role: str, complete: Callable[[], str]
) -> str:
    """Pause the `paused_role` engine, send the request, SIGKILL the store once the api has
    sent that engine its part (its own count), resume the engine; the completion's text."""
    paused = _engine(server, paused_role)
    (store_pid, *_) = _store_pids(server)[-1:]
    num_stores = len(_store_pids(server))
    os.kill(paused["pid"], signal.SIGSTOP)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            text = pool.submit(complete)
            sent = lambda: _engine(server, paused_role)["num_in_flight"] == 1  # noqa: E731
            assert wait_until(sent, timeout_s=60, interval_s=0.01), server.health()[1]
            os.kill(store_pid, signal.SIGKILL)
            os.kill(paused["pid"], signal.SIGCONT)
            result = text.result(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(paused["pid"], signal.SIGCONT)
    restarted = lambda: len(_store_pids(server)) == num_stores + 1  # noqa: E731
    assert wait_until(restarted, timeout_s=30), server.log()
    return result


@pytest.mark.parametrize("paused_role", ["kv_consumer", "kv_producer"])
def test_the_store_killed_mid_transfer_costs_no_request(server, paused_role):
    def complete() -> str:
        return server.complete(PROMPT, max_tokens=MAX_TOKENS)  # ends by length, no error

    reference = complete()
    _forget_cached_prefixes(server)

    assert _complete_with_store_killed(server, paused_role, complete) == reference

    # The restarted store serves the next transfers, and nothing is left held.
    _forget_cached_prefixes(server)
    assert complete() == reference
    status, body = server.health()
    assert status == 200 and body["status"] == "healthy", body
    assert all(e["num_in_flight"] == 0 for e in body["engines"]), body


def _kill_and_wait_for_restart(server: ServeProcess, kv_role: str, while_paused=None) -> int:
    """SIGKILL the `kv_role` engine core (paused for `while_paused()` first, if given); its
    pid, once /health shows a new process of it serving and the server healthy."""
    engine = _engine(server, kv_role)
    if while_paused is not None:
        os.kill(engine["pid"], signal.SIGSTOP)
        while_paused()
    os.kill(engine["pid"], signal.SIGKILL)

    def restarted() -> bool:
        status, body = server.health()
        new = [e for e in body["engines"] if e.get("kv_role") == kv_role]
        return status == 200 and new[0]["pid"] != engine["pid"] and new[0]["state"] == "serving"

    assert wait_until(restarted, timeout_s=60), server.log()
    return engine["pid"]


def test_a_prefill_in_transit_as_its_lone_engine_dies_waits_for_the_restart(server):
    reference = server.complete(PROMPT, max_tokens=MAX_TOKENS)
    _forget_cached_prefixes(server)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        texts: list[concurrent.futures.Future] = []

        def send_until_its_prefill_copy_is_on_the_engine() -> None:
            texts.append(pool.submit(server.complete, PROMPT, MAX_TOKENS))
            in_flight = lambda: _engine(server, "kv_producer")["num_in_flight"] == 1  # noqa: E731
            assert wait_until(in_flight, timeout_s=60, interval_s=0.01), server.health()[1]

        _kill_and_wait_for_restart(
            server, "kv_producer", send_until_its_prefill_copy_is_on_the_engine
        )
        assert texts[0].result(timeout=120) == reference
    assert "is held for a restarted engine core" in server.log()
    assert server.complete(PROMPT, max_tokens=MAX_TOKENS) == reference
    assert all(e["num_in_flight"] == 0 for e in server.health()[1]["engines"])


def _rings_of(pids: set[int]) -> list[str]:
    """The shared-memory rings in /dev/shm that processes `pids` created."""
    paths = glob.glob("/dev/shm/kvserve-ring-*")
    return sorted(p for p in paths if int(os.path.basename(p).split("-")[2]) in pids)


def test_a_killed_engine_leaves_no_shared_memory_behind(server):
    def engine_pids() -> set[int]:
        return {e["pid"] for e in server.health()[1]["engines"]}

    before = _rings_of(engine_pids())
    assert len(before) == 2, before  # each engine core's ring to its worker
    dead_pid = _kill_and_wait_for_restart(server, "kv_consumer")
    assert _rings_of({dead_pid}) == []
    assert len(_rings_of(engine_pids())) == len(before)
    assert server.complete(PROMPT, max_tokens=MAX_TOKENS)
