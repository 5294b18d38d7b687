"""--scheduling-policy fair through a real server: tenants named by a trusted X-Tenant
header, the tiny model, the official openai client.

One engine with one seat (--max-num-seqs 1): requests are scheduled one at a time, each
after the one before finished, so the order in which streams end is the engine's scheduling
order (no timing is asserted; a random model's first tokens may decode to no text, so a
stream's first chunk can come late, its end cannot). With
two engine cores, a heavy tenant whose prompts share a prefix lands on one engine (prefix
routing), and its cluster-wide share still holds: each engine counts what a tenant got on
the other (fair_share.py).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Iterator

import openai
import pytest

from tests.support.server import DP_MODEL_NAME, ServeProcess, start_tiny_server
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

HEAVY_BACKLOG = 8


@contextlib.contextmanager
def _serving(model_dir: str, log_dir, *flags: str) -> Iterator[ServeProcess]:
    server = start_tiny_server(model_dir, log_dir, "--tenant-header", "X-Tenant", *flags)
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
    """One streamed completion; on_end() once it ended; returns its tokens."""
    chunks = client.completions.create(
        model=DP_MODEL_NAME,
        prompt=prompt,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    completion_tokens = 0
    for chunk in chunks:
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
    on_end()
    return completion_tokens


def _scheduling_order(server: ServeProcess) -> list[str]:
    """A heavy backlog, then two light requests while the first heavy one runs; the order
    the engine scheduled them in (with one seat: the order their streams ended)."""
    order: list[str] = []
    lock = threading.Lock()

    def ended(name: str):
        def mark() -> None:
            with lock:
                order.append(name)

        return mark

    heavy, light = _client(server, "heavy"), _client(server, "light")
    with concurrent.futures.ThreadPoolExecutor(HEAVY_BACKLOG + 2) as pool:
        futures = [
            pool.submit(_stream, heavy, [5 + i, 6, 7], 150, ended(f"heavy{i}"))
            for i in range(HEAVY_BACKLOG)
        ]
        # The whole backlog is in the engine, one running, before the light tenant sends.
        assert wait_until(
            lambda: server.health()[1]["engines"][0]["num_waiting"] >= HEAVY_BACKLOG - 1,
            timeout_s=30,
        ), server.health()
        assert not order, f"{order} ended before the light tenant sent: make them longer"
        futures += [
            pool.submit(_stream, light, [9, 10 + i], 20, ended(f"light{i}")) for i in range(2)
        ]
        for future in futures:
            assert future.result(timeout=120) > 0
    assert len(order) == HEAVY_BACKLOG + 2, order
    return order


def test_fair_admits_the_light_tenant_ahead_of_the_heavy_backlog(tiny_llama_dir, tmp_path):
    with _serving(
        tiny_llama_dir, tmp_path, "--scheduling-policy", "fair", "--max-num-seqs", "1"
    ) as server:
        order = _scheduling_order(server)
    # The first light request takes the next seat; the second comes before the backlog ends
    # (the light tenant, lifted to the heavy one's counter, then alternates with it).
    first, second = sorted(_light_positions(order))
    assert first == 1, order
    assert second < HEAVY_BACKLOG, order


def test_fcfs_makes_the_light_tenant_wait_for_the_backlog(tiny_llama_dir, tmp_path):
    with _serving(
        tiny_llama_dir, tmp_path, "--scheduling-policy", "fcfs", "--max-num-seqs", "1"
    ) as server:
        order = _scheduling_order(server)
    assert _light_positions(order) == [HEAVY_BACKLOG, HEAVY_BACKLOG + 1], order


def _light_positions(order: list[str]) -> list[int]:
    """Where the light requests were scheduled (the two were sent at once: either first)."""
    return [i for i, name in enumerate(order) if name.startswith("light")]


def _closed_loop(
    client: openai.OpenAI, prompts, stop: threading.Event, served: dict, tenant: str
) -> None:
    """Send one request after another (32 tokens each) until `stop`; count the tokens."""
    for prompt in prompts:
        if stop.is_set():
            return
        completion = client.completions.create(
            model=DP_MODEL_NAME, prompt=prompt, max_tokens=32, extra_body={"ignore_eos": True}
        )
        served[tenant] += completion.usage.completion_tokens


def test_dp_a_tenant_pinned_to_one_engine_keeps_its_cluster_share(tiny_llama_dir, tmp_path):
    # Heavy's prompts share 48 tokens (3 blocks of the tiny model's 16): prefix routing keeps
    # them on one engine. Light sends three times as many at once and fills both engines.
    # Each engine on its own would split its seats between the tenants it sees, giving heavy
    # a quarter of the cluster; counting what light gets on the other engine, heavy takes
    # its engine's seats and holds about half.
    prefix = list(range(20, 68))
    with _serving(
        tiny_llama_dir,
        tmp_path,
        "--scheduling-policy",
        "fair",
        "--data-parallel-size",
        "2",
        "--dp-routing",
        "prefix",
        "--max-num-seqs",
        "2",
    ) as server:
        served = {"heavy": 0, "light": 0}
        stop = threading.Event()
        heavy, light = _client(server, "heavy"), _client(server, "light")
        heavy_prompts = [[*prefix, 100 + i, 7] for i in range(10_000)]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            futures = [
                pool.submit(_closed_loop, heavy, heavy_prompts[i::4], stop, served, "heavy")
                for i in range(4)
            ] + [
                pool.submit(
                    _closed_loop,
                    light,
                    [[5 + i, 200 + j % 50, 9] for j in range(10_000)],
                    stop,
                    served,
                    "light",
                )
                for i in range(12)
            ]
            assert wait_until(lambda: sum(served.values()) >= 32 * 150, timeout_s=240), served
            stop.set()
            for future in futures:
                future.result(timeout=120)
        hits = [server.metric("kvserve:prefix_cache_hits_total", i) for i in (0, 1)]
    # Heavy did stay on one engine: nearly all prefix hits (only heavy's prompts share
    # blocks) are that engine's.
    assert max(hits) >= 0.9 * sum(hits) > 0, hits
    share = served["heavy"] / sum(served.values())
    assert 0.4 < share < 0.6, served
