"""P/D disaggregation end to end: `kvserve serve --prefill-size N --decode-size M` as a user
runs it, on the default model in float32.

Real processes (api, KV store, DP coordinator, prefill and decode engine cores), real HTTP,
the official openai client. Greedy replies equal the engine's own; aborts at every stage
leave every engine's KV cache free and the store without pins; a prefill engine killed with
requests in flight fails them clearly (one prefill engine) or is retried on the other (two);
SIGTERM stops the store and takes its shared memory with it.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import random
import re
import signal
import threading
import time

import httpx
import openai
import pytest

from kvserve import LLM, SamplingParams
from kvserve.services.kv_store.client import KvStoreClient
from tests.support.kv_store import tiny_fingerprint
from tests.support.metrics import engine_idle, metrics_text, read_metric
from tests.support.ports import free_port
from tests.support.resources import release_freed_memory
from tests.support.server import ServeProcess
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

MODEL_NAME = "smol-pd"
MAX_TOKENS = 24
CHATS = [
    "Name three colours.",
    "What is the capital of France? Answer in one sentence.",
    "Count from one to ten in words.",
]
# ~1,500 prompt tokens: its prefill takes seconds on a CPU, long enough to abort during it.
LONG_PROMPT = "Summarise the following words. " + "apple banana cherry " * 500


def start_pd_server(tmp_path, num_prefill: int, num_decode: int = 1) -> ServeProcess:
    port = free_port()
    return ServeProcess(
        [
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "256MiB",
            "--served-model-name",
            MODEL_NAME,
            "--uvicorn-log-level",
            "warning",
            "--prefill-size",
            str(num_prefill),
            "--decode-size",
            str(num_decode),
            "--kv-store-size",
            "256M",
        ],
        str(tmp_path / f"serve-pd-{port}.log"),
        port,
        served_model_name=MODEL_NAME,
    )


@pytest.fixture(scope="module")
def pd_server(default_model_dir, tmp_path_factory):
    server = start_pd_server(tmp_path_factory.mktemp("pd"), num_prefill=1)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reference(default_model_dir) -> list[str]:
    llm = LLM(dtype="float32", kv_cache_memory=64 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    conversations = [[{"role": "user", "content": chat}] for chat in CHATS]
    texts = [o.outputs[0].text for o in llm.chat(conversations, params, use_tqdm=False)]
    del llm
    release_freed_memory()  # before the server's three engine processes start
    return texts


def _openai(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _store_stats(server: ServeProcess):
    _, body = server.health()
    # A stats query opens no pool: any fingerprint will do.
    client = KvStoreClient(body["kv_store"], tiny_fingerprint(), timeout_s=5, connect=False)
    try:
        return client.stats()
    finally:
        client.close()


def _all_idle(server: ServeProcess) -> bool:
    stats = _store_stats(server)
    return engine_idle(server.url) and stats.num_pinned == 0 and stats.num_reserved == 0


def test_pd_greedy_equals_the_engines_own(reference, pd_server):
    status, body = pd_server.health()
    assert status == 200 and body["status"] == "healthy", body
    assert [(e["engine"], e["kv_role"]) for e in body["engines"]] == [
        (0, "kv_producer"),
        (1, "kv_consumer"),
    ]
    assert body["kv_store"].startswith("ipc://")
    client = _openai(pd_server)
    for chat, expected in zip(CHATS, reference, strict=True):
        messages = [{"role": "user", "content": chat}]
        reply = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0
        )
        assert reply.choices[0].message.content == expected
        chunks = client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            stream=True,
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == expected
    # Both stages ran every prompt: the prefill engine (its copies) and the decode engine.
    for engine in (0, 1):
        assert pd_server.metric("kvserve:prefix_cache_queries_total", engine) > 0, engine
    # The KV moved: the prefill engine saved the prompts' full blocks, the decode engine
    # loaded them (external hits) instead of computing them.
    assert pd_server.metric("kvserve:kv_transfer_bytes_saved_total", 0) > 0
    assert pd_server.metric("kvserve:kv_transfer_bytes_loaded_total", 1) > 0
    assert pd_server.metric("kvserve:external_prefix_cache_hits_total", 1) > 0
    assert pd_server.metric("kvserve:external_prefix_cache_hits_total", 0) == 0
    # The client saw ordinary requests: only the decode engine's count as served.
    text = metrics_text(pd_server.url)
    served = read_metric(
        text, "kvserve:request_success_total", engine="1", finished_reason="length"
    )
    served += read_metric(
        text, "kvserve:request_success_total", default=0.0, engine="1", finished_reason="stop"
    )
    assert served == 2 * len(CHATS)
    assert wait_until(lambda: _all_idle(pd_server))


def _stream(url: str, body: dict, num_chunks: int, read_timeout_s: float = 60.0) -> int:
    """A streamed completion closed after num_chunks data lines (or at a read timeout);
    returns the data lines read."""
    timeout = httpx.Timeout(60.0, read=read_timeout_s)
    num_read = 0
    try:
        with httpx.stream(
            "POST", url + "/v1/completions", json=body | {"stream": True}, timeout=timeout
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    num_read += 1
                    if num_read >= num_chunks:
                        break
    except httpx.ReadTimeout:
        pass
    return num_read


def _body(prompt: str, max_tokens: int) -> dict:
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }


def test_aborts_at_every_stage_free_every_cache_and_pin(pd_server):
    url = pd_server.url
    decode_queries = pd_server.metric("kvserve:prefix_cache_queries_total", 1)

    # While prefilling: gone before the prefill engine is done with the long prompt.
    assert _stream(url, _body(LONG_PROMPT, 8), num_chunks=1, read_timeout_s=0.5) == 0
    assert wait_until(lambda: _all_idle(pd_server), timeout_s=30)
    # The decode was never sent.
    assert pd_server.metric("kvserve:prefix_cache_queries_total", 1) == decode_queries

    # While decoding: a few tokens streamed, then gone.
    assert _stream(url, _body("Tell me a long story.", 400), num_chunks=3) == 3
    assert wait_until(lambda: _all_idle(pd_server), timeout_s=30)

    # A storm of streams, each cancelled at its own point (some while prefilling).
    rng = random.Random(0)
    plans = [(rng.randrange(0, 6), rng.choice([0.05, 0.3, 60.0])) for _ in range(20)]
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        list(
            pool.map(
                lambda plan: _stream(
                    url, _body(f"Story {plan}: once upon a time", 40), max(plan[0], 1), plan[1]
                ),
                plans,
            )
        )
    assert wait_until(lambda: _all_idle(pd_server), timeout_s=45), metrics_text(url)
    status, body = pd_server.health()
    assert status == 200 and body["status"] == "healthy", body


def test_a_killed_store_is_restarted_and_requests_only_recompute(pd_server):
    """SIGKILL of the KV store under load: every request completes (the decode engine
    computes the prompt itself), the launcher starts an empty store on the same address,
    unlinks the dead one's shared memory, and KV moves through the new one."""
    (pid,) = map(
        int, re.findall(r"started KV store process KvStore \(pid (\d+)\)", pd_server.log())
    )
    store_address = pd_server.health()[1]["kv_store"]
    client = _openai(pd_server)

    def complete(index: int) -> str:
        reply = client.completions.create(
            model=MODEL_NAME,
            prompt=f"{index}: {LONG_PROMPT[:400]}",
            max_tokens=4,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert reply.choices[0].finish_reason == "length"
        return reply.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(complete, i) for i in range(8)]
        time.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
        assert all(future.result(timeout=120) for future in futures)
    assert wait_until(
        lambda: len(re.findall(r"started KV store process KvStore", pd_server.log())) == 2,
        timeout_s=20,
    ), pd_server.log()
    assert not [name for name in _shm_segments(store_address) if name.endswith(f"-{pid}")]
    loaded = pd_server.metric("kvserve:kv_transfer_bytes_loaded_total", 1)
    assert complete(100)  # a fresh prompt, prefilled into the new store and loaded from it
    assert wait_until(
        lambda: pd_server.metric("kvserve:kv_transfer_bytes_loaded_total", 1) > loaded,
        timeout_s=20,
    )
    assert wait_until(lambda: _all_idle(pd_server), timeout_s=30)
    status, body = pd_server.health()
    assert status == 200 and body["status"] == "healthy", body


def _kill_prefill_mid_flight(server: ServeProcess, num_requests: int) -> list[object]:
    """Stream num_requests long-prompt completions, SIGKILL engine 0 (a prefill engine) once
    it holds some, and return each one's outcome: its text, or the error it met."""
    _, body = server.health()
    victim = next(e for e in body["engines"] if e["engine"] == 0)
    assert victim["kv_role"] == "kv_producer"
    started = threading.Event()

    def run(index: int) -> object:
        started.wait(30)
        try:
            chunks = _openai(server).completions.create(
                model=MODEL_NAME,
                prompt=f"{index}: {LONG_PROMPT[: 5000 + 40 * index]}",
                max_tokens=4,
                temperature=0.0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            return "".join(c.choices[0].text for c in chunks if c.choices)
        except (openai.APIError, httpx.HTTPError) as exc:
            return exc

    with concurrent.futures.ThreadPoolExecutor(num_requests) as pool:
        futures = [pool.submit(run, i) for i in range(num_requests)]
        started.set()
        # Together the prompts are over one step's 2,048-token budget, so their prefill
        # takes two engine steps of about a second each (stats come only at a step's end):
        # half a second in, the copies are on the prefill engines, mid-step. (Prompts of one
        # short step raced the kill once prefill attention got faster.)
        time.sleep(0.5)
        os.kill(victim["pid"], signal.SIGKILL)
        return [future.result(timeout=60) for future in futures]


def test_a_killed_lone_prefill_engine_fails_its_requests_clearly(pd_server):
    outcomes = _kill_prefill_mid_flight(pd_server, 3)
    errors = [outcome for outcome in outcomes if isinstance(outcome, Exception)]
    assert errors, outcomes
    for error in errors:
        message = str(error)
        assert "engine core" in message and ("503" in message or "EngineDeadError" in message), (
            message
        )
    assert any("prefill" in str(error) for error in errors), errors
    # No prefill engine left: the server exits 1, as when no engine at all is left.
    assert pd_server.process.wait(timeout=30) == 1, pd_server.log()
    assert "no prefill engine core is left" in pd_server.log()


def _shm_segments(store_address: str) -> list[str]:
    where = hashlib.sha256(store_address.encode()).hexdigest()[:12]
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"kvserve-kv-{where}")]


def test_two_prefill_engines_survive_a_kill_and_sigterm_cleans_up(default_model_dir, tmp_path):
    server = start_pd_server(tmp_path, num_prefill=2)
    try:
        server.wait_healthy()
        _, body = server.health()
        assert [e["kv_role"] for e in body["engines"]] == ["kv_producer"] * 2 + ["kv_consumer"]
        store_address = body["kv_store"]

        outcomes = _kill_prefill_mid_flight(server, 4)
        assert all(isinstance(outcome, str) and outcome for outcome in outcomes), outcomes
        assert "retrying on another prefill engine core" in server.log()
        status, body = server.health()
        assert status == 200 and body["status"] == "degraded", body
        assert [e["state"] for e in body["engines"]] == ["dead", "serving", "serving"]
        assert (
            _openai(server)
            .completions.create(
                model=MODEL_NAME, prompt="After the kill:", max_tokens=4, temperature=0.0
            )
            .choices[0]
            .text
        )
        assert wait_until(lambda: _all_idle(server), timeout_s=30)
    finally:
        exit_code = server.stop()  # also: no descendant outlives it
    assert exit_code == 0, server.log()
    assert "KV store stopped" in server.log()
    assert not os.path.exists(store_address.removeprefix("ipc://"))
    assert not _shm_segments(store_address)
