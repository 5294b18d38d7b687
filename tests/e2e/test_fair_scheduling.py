"""--scheduling-policy fair through a real server: tenants named by a trusted X-Tenant
header (or by API key, weights from the key file), the tiny model, the official openai
client.

With one seat (--max-num-seqs 1) requests are scheduled one at a time, each after the one
before finished, so the order in which streams end is the engine's scheduling order (no
timing is asserted; a random model's first tokens may decode to no text, so a stream's first
chunk can come late, its end cannot). A backlog is queued whole by pausing the engine cores
(SIGSTOP) while it is sent. With two engine cores, prompts that share a prefix stay on one
engine (prefix routing, a wide --dp-prefix-slack), and a tenant's service on the other
engine counts there too (fair_share.py).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import signal
import time
from collections.abc import Callable, Iterator

import openai
import pytest

from tests.support.server import DP_MODEL_NAME, ServeProcess, start_tiny_server
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

HEAVY_BACKLOG = 8
# Tokens of each heavy request: long beside the moment the light ones take to arrive after the
# backlog is let go (asserted: most of the backlog is still queued then).
HEAVY_TOKENS = 200
RECEIVED = "Received request"  # the api's --enable-log-requests line


@contextlib.contextmanager
def _serving(model_dir: str, log_dir, *flags: str) -> Iterator[ServeProcess]:
    server = start_tiny_server(
        model_dir, log_dir, "--tenant-header", "X-Tenant", "--enable-log-requests", *flags
    )
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def _client(server: ServeProcess, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1",
        api_key="none",
        default_headers={"X-Tenant": tenant},
        max_retries=0,
        timeout=120,
    )


def _stream(client: openai.OpenAI, prompt: list[int], max_tokens: int, on_end) -> int:
    """One streamed completion; on_end(its id) once it ended; returns its tokens."""
    chunks = client.completions.create(
        model=DP_MODEL_NAME,
        prompt=prompt,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    completion_tokens, request_id = 0, ""
    for chunk in chunks:
        request_id = chunk.id
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
    on_end(request_id)
    return completion_tokens


@contextlib.contextmanager
def _paused(server: ServeProcess) -> Iterator[Callable[[int], None]]:
    """The engine cores stopped (SIGSTOP) inside: what is sent meanwhile queues at their
    sockets, and they take it all in at once when they go on (SIGCONT). Yields
    `submitted(n)`, which waits until the api took n requests since the pause (its
    --enable-log-requests lines) and sent them on."""
    pids = _engine_pids(server)
    num_before = server.log().count(RECEIVED)

    def submitted(num_requests: int) -> None:
        assert wait_until(
            lambda: server.log().count(RECEIVED) >= num_before + num_requests, timeout_s=60
        ), f"the api took {server.log().count(RECEIVED) - num_before} of {num_requests}"
        time.sleep(1.0)  # from the log line to the engine's socket: a few awaits

    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield submitted
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def _engine_pids(server: ServeProcess) -> list[int]:
    return [engine["pid"] for engine in server.health()[1]["engines"]]


# The api's line as a request ends (with its key's name when it used one).
FINISHED = re.compile(r"request (\S+)(?: \(API key '[^']*'\))? finished \(")


class EndOrder:
    """Names requests by id as their clients see them end; `names` puts them in the order
    the server ended them (its log: the order the engine's outputs came, which no client
    thread's scheduling can shuffle)."""

    def __init__(self) -> None:
        self._names: dict[str, str] = {}

    def ended(self, name: str) -> Callable[[str], None]:
        """A callback that names the request id it is given `name`."""
        return lambda request_id: self._names.__setitem__(request_id, name)

    def names(self, server: ServeProcess) -> list[str]:
        return [
            self._names[match[1]]
            for match in FINISHED.finditer(server.log())
            if match[1] in self._names
        ]


def _scheduling_order(server: ServeProcess) -> tuple[list[str], int]:
    """A heavy backlog, queued whole, then two light requests while it runs; the order the
    engine scheduled them in (with one seat: the order their streams ended), and how many
    heavy requests had ended when the light ones were sent."""
    order = EndOrder()
    ended = order.ended
    num_finished_before = len(FINISHED.findall(server.log()))
    heavy, light = _client(server, "heavy"), _client(server, "light")
    with concurrent.futures.ThreadPoolExecutor(HEAVY_BACKLOG + 2) as pool:
        with _paused(server) as submitted:
            futures = [
                pool.submit(_stream, heavy, [5 + i, 6, 7], HEAVY_TOKENS, ended(f"heavy{i}"))
                for i in range(HEAVY_BACKLOG)
            ]
            submitted(HEAVY_BACKLOG)
        num_ended_before = len(FINISHED.findall(server.log())) - num_finished_before
        futures += [
            pool.submit(_stream, light, [9, 10 + i], 100, ended(f"light{i}")) for i in range(2)
        ]
        for future in futures:
            assert future.result(timeout=120) > 0
    names = order.names(server)
    assert len(names) == HEAVY_BACKLOG + 2, names
    assert num_ended_before < HEAVY_BACKLOG - 2, f"{names}: make the heavy requests longer"
    return names, num_ended_before


def test_fair_admits_the_light_tenant_ahead_of_the_heavy_backlog(tiny_llama_dir, tmp_path):
    with _serving(
        tiny_llama_dir, tmp_path, "--scheduling-policy", "fair", "--max-num-seqs", "1"
    ) as server:
        order, num_ended_before = _scheduling_order(server)
    # The first light request takes the next free seat (one more heavy request may end
    # while it is on its way); the second comes before the backlog ends (the light tenant,
    # lifted to the heavy one's counter, then alternates with it).
    first, second = sorted(_light_positions(order))
    assert first <= num_ended_before + 2, (order, num_ended_before)
    assert second < HEAVY_BACKLOG, order


def test_fcfs_makes_the_light_tenant_wait_for_the_backlog(tiny_llama_dir, tmp_path):
    with _serving(
        tiny_llama_dir, tmp_path, "--scheduling-policy", "fcfs", "--max-num-seqs", "1"
    ) as server:
        order, _ = _scheduling_order(server)
    assert _light_positions(order) == [HEAVY_BACKLOG, HEAVY_BACKLOG + 1], order


def _light_positions(order: list[str]) -> list[int]:
    """Where the light requests were scheduled (the two were sent at once: either first)."""
    return [i for i, name in enumerate(order) if name.startswith("light")]


def test_dp_a_tenant_pinned_to_one_engine_keeps_its_cluster_share(tiny_llama_dir, tmp_path):
    # Two engines of one seat; prompts that start alike stay on one engine (prefix routing
    # with a wide slack). Light keeps engine A busy with long prompts of its own prefix; then
    # light and heavy queue six requests each with another prefix, which go to engine B.
    # Served on A all along, light is the more served tenant on B too: B runs heavy's
    # requests ahead of light's. B on its own would alternate them.
    light_prefix, shared_prefix = list(range(20, 52)), list(range(60, 92))
    with _serving(
        tiny_llama_dir,
        tmp_path,
        "--scheduling-policy",
        "fair",
        "--data-parallel-size",
        "2",
        "--dp-routing",
        "prefix",
        "--dp-prefix-slack",
        "1000",
        "--max-num-seqs",
        "1",
    ) as server:
        heavy, light = _client(server, "heavy"), _client(server, "light")
        order = EndOrder()
        ended = order.ended

        with concurrent.futures.ThreadPoolExecutor(52) as pool:
            with _paused(server) as submitted:
                # Engine A: light's own prefix, long prompts (each charged for ~400
                # tokens), a backlog that outlasts B's queue.
                futures = [
                    pool.submit(
                        _stream,
                        light,
                        [*light_prefix, i, *(100 + (k * 7 + i) % 150 for k in range(380))],
                        60,
                        ended(f"light-A{i}"),
                    )
                    for i in range(40)
                ]
                submitted(40)  # routed to A before the others come
                for i in range(6):
                    futures.append(
                        pool.submit(_stream, light, [*shared_prefix, i], 450, ended(f"light-B{i}"))
                    )
                    futures.append(
                        pool.submit(
                            _stream,
                            heavy,
                            [*shared_prefix, 50 + i],
                            450,
                            ended(f"heavy-B{i}"),
                        )
                    )
                submitted(52)
            for future in futures:
                assert future.result(timeout=240) in (60, 450)
        hits = [server.metric("kvserve:prefix_cache_hits_total", i) for i in (0, 1)]
        engines = server.health()[1]["engines"]
        names = order.names(server)
    assert all(hits), hits  # each engine served one prefix again and again
    assert len(engines) == 2
    on_b = [name for name in names if name.endswith(tuple(f"-B{i}" for i in range(6)))]
    # B's first seven: at most the first (the two tenants start even) and one more light.
    assert sum(name.startswith("light") for name in on_b[:7]) <= 2, on_b


def test_weights_two_to_one_serve_tokens_two_to_one(tiny_llama_dir, tmp_path):
    # Tenants by API key, weights from the key file; each queues 60 requests at once (of
    # one size) on three seats. While both still wait, gold gets twice bronze's tokens.
    key_file = tmp_path / "keys"
    key_file.write_text("gold:sk-gold weight=2\nbronze:sk-bronze\n")
    with _serving(
        tiny_llama_dir,
        tmp_path,
        "--scheduling-policy",
        "fair",
        "--max-num-seqs",
        "3",
        "--api-key-file",
        str(key_file),
    ) as server:
        clients = {
            tenant: openai.OpenAI(
                base_url=server.url + "/v1", api_key=f"sk-{tenant}", max_retries=0, timeout=120
            )
            for tenant in ("gold", "bronze")
        }
        order = EndOrder()

        def run(tenant: str, index: int) -> None:
            completion = clients[tenant].completions.create(
                model=DP_MODEL_NAME,
                prompt=[5 + index % 100, 200, 9],
                max_tokens=64,
                extra_body={"ignore_eos": True},
            )
            assert completion.usage.completion_tokens == 64
            order.ended(tenant)(completion.id)

        with concurrent.futures.ThreadPoolExecutor(120) as pool:
            with _paused(server) as submitted:
                futures = [
                    pool.submit(run, tenant, i) for i in range(60) for tenant in ("gold", "bronze")
                ]
                submitted(120)
            for future in futures:
                future.result(timeout=240)
        names = order.names(server)
    assert len(names) == 120, names
    first_half = names[:60]  # both tenants still had requests waiting
    ratio = first_half.count("gold") / first_half.count("bronze")
    assert ratio == pytest.approx(2.0, rel=0.1), names
