"""--enable-sleep-mode on a real `kvserve serve` of the tiny model with two engines (data
parallelism): POST /sleep frees every engine process's memory (RSS, read with psutil from the
pids /health names), every request is a 503 naming it while asleep, and POST /wake_up serves
the same greedy output as before. Then TP = 2 through the offline `LLM`: every worker sleeps.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from tests.support.metrics import metrics_text, read_metric
from tests.support.server import start_tiny_server

# A KV cache big enough that freeing it stands out of the RSS noise, small enough to zero fast.
KV_CACHE_MEMORY = 96 << 20
NUM_ENGINES = 2  # data parallelism: every engine sleeps and wakes
PROMPT = "The capital of France is"
_KV_LOG = re.compile(r"KV cache: \d+ blocks of \d+ tokens, ([0-9.]+) MiB")


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    serve = start_tiny_server(
        tiny_llama_dir,
        tmp_path_factory.mktemp("sleep"),
        "--enable-sleep-mode",
        "--kv-cache-memory",
        str(KV_CACHE_MEMORY),
        "--data-parallel-size",
        str(NUM_ENGINES),
    )
    try:
        serve.wait_healthy()
        yield serve
    finally:
        serve.stop()


def engine_rss(serve) -> list[int]:
    """Each engine core process's RSS, by engine index."""
    status, body = serve.health()
    assert status == 200, body
    engines = sorted(body["engines"], key=lambda e: e["engine"])
    assert len(engines) == NUM_ENGINES, body
    return [psutil.Process(e["pid"]).memory_info().rss for e in engines]


def freed(before: list[int], after: list[int]) -> list[int]:
    return [b - a for b, a in zip(before, after)]


def kv_cache_bytes(serve) -> int:
    """The KV cache's size as the engine logged it at start-up."""
    mib = _KV_LOG.findall(serve.log())[0]  # start-up's (each wake_up logs it again)
    return int(float(mib) * 2**20)


def is_sleeping(serve) -> bool:
    response = httpx.get(serve.url + "/is_sleeping", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()["is_sleeping"]


def sleep_states(serve, engine: int = 1) -> dict[str, float]:
    """kvserve:engine_sleep_state of one engine, by its sleep_state label."""
    text = metrics_text(serve.url)
    states = ("awake", "weights_offloaded", "discard_all")
    return {
        s: read_metric(text, "kvserve:engine_sleep_state", engine=str(engine), sleep_state=s)
        for s in states
    }


def greedy_text(serve) -> str:
    """The greedy completion of PROMPT, asked of every engine at once (concurrent requests
    spread over the engines): one text."""
    with ThreadPoolExecutor(2 * NUM_ENGINES) as pool:
        texts = set(pool.map(lambda _: serve.complete(PROMPT, 12), range(2 * NUM_ENGINES)))
    assert len(texts) == 1, texts
    return texts.pop()


def post(serve, path: str, **params) -> httpx.Response:
    return httpx.post(serve.url + path, params=params, timeout=120)


def refused_while_asleep(serve) -> None:
    response = httpx.post(
        serve.url + "/v1/completions",
        json={"model": serve.served_model_name, "prompt": PROMPT, "max_tokens": 4},
        timeout=30,
    )
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert "asleep" in error["message"] and "/wake_up" in error["message"], error
    assert error["type"] == "ServiceUnavailableError", error


def test_sleep_level_1_frees_the_kv_cache_and_wakes_to_the_same_output(server):
    before = greedy_text(server)
    text = metrics_text(server.url)
    for engine in range(NUM_ENGINES):  # every engine served some of them
        served = read_metric(
            text, "kvserve:request_success_total", engine=str(engine), finished_reason="length"
        )
        assert served > 0, engine
    assert not is_sleeping(server)
    kv_bytes = kv_cache_bytes(server)
    assert kv_bytes >= KV_CACHE_MEMORY * 0.9, kv_bytes
    rss_awake = engine_rss(server)

    assert sleep_states(server) == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
    assert post(server, "/sleep", level=1).status_code == 200
    assert is_sleeping(server)
    assert sleep_states(server) == {"awake": 0, "weights_offloaded": 1, "discard_all": 0}
    rss_asleep = engine_rss(server)
    assert all(f >= kv_bytes for f in freed(rss_awake, rss_asleep)), (rss_awake, rss_asleep)
    refused_while_asleep(server)
    assert post(server, "/sleep", level=1).status_code == 200  # asleep already: a no-op

    assert post(server, "/wake_up").status_code == 200
    assert not is_sleeping(server)
    # The cache is back, zeroed, in every engine.
    assert all(f >= kv_bytes * 0.9 for f in freed(engine_rss(server), rss_asleep))
    assert greedy_text(server) == before


def test_sleep_level_2_drops_the_weights_and_wakes_from_the_checkpoint(server):
    before = greedy_text(server)
    rss_awake = engine_rss(server)
    assert post(server, "/sleep", level=2).status_code == 200
    assert is_sleeping(server)
    assert sleep_states(server) == {"awake": 0, "weights_offloaded": 0, "discard_all": 1}
    assert all(f >= kv_cache_bytes(server) for f in freed(rss_awake, engine_rss(server)))
    refused_while_asleep(server)

    # The KV cache cannot come back before the weights; the weights alone do not serve.
    response = post(server, "/wake_up", tags="kv_cache")
    assert response.status_code == 400 and "weights" in response.json()["error"]["message"]
    assert post(server, "/wake_up", tags="weights").status_code == 200
    assert is_sleeping(server)
    refused_while_asleep(server)
    assert post(server, "/wake_up", tags="kv_cache").status_code == 200
    assert not is_sleeping(server)
    assert sleep_states(server)["awake"] == 1
    assert greedy_text(server) == before


def test_bad_sleep_arguments_are_refused(server):
    response = post(server, "/sleep", level=3)
    assert response.status_code == 400 and "level" in response.json()["error"]["message"]
    response = post(server, "/wake_up", tags="everything")
    assert response.status_code == 400 and "tags" in response.json()["error"]["message"]
    assert not is_sleeping(server)


# ------------------------------------------------- TP = 2: the call reaches every worker

TP_KV_CACHE_MEMORY = 64 << 20  # per rank


@pytest.mark.slow
def test_tensor_parallel_workers_all_sleep_and_wake(tmp_path_factory, default_model_dir):
    from kvserve import LLM, SamplingParams
    from tests.support.models import save_tiny_parallel_llama
    from tests.support.processes import wait_gone

    model = save_tiny_parallel_llama(str(tmp_path_factory.mktemp("tiny-parallel-llama")))
    llm = LLM(
        model,
        tokenizer=default_model_dir,
        dtype="float32",
        tensor_parallel_size=2,
        kv_cache_memory=TP_KV_CACHE_MEMORY,
        max_model_len=256,
        enable_sleep_mode=True,
    )
    pids = llm.engine_core.executor.worker_pids
    assert len(pids) == 2
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 5, 9, 13, 17, 21]}, {"prompt_token_ids": [2, 4, 8]}]

    def tokens() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    def rss() -> list[int]:
        return [psutil.Process(pid).memory_info().rss for pid in pids]

    try:
        before = tokens()
        # A request in flight: nothing is freed (vLLM >= 0.17 would abort it by default).
        llm._add_request("in-flight", None, [3, 6, 9], greedy, 0)
        llm.engine_core.step()
        with pytest.raises(RuntimeError, match="in flight"):
            llm.sleep(1)
        assert not llm.is_sleeping()
        (finished,) = llm._run_engine({"in-flight": 0}, use_tqdm=False)
        assert finished.outputs[0].finish_reason == "length"  # it ran to its end
        for level in (1, 2):
            awake = rss()
            llm.sleep(level)
            assert llm.is_sleeping()
            asleep = rss()
            # Every rank freed its own KV cache (its blocks fill the budget to within a block).
            for rank, (a, b) in enumerate(zip(awake, asleep)):
                assert a - b >= 0.9 * TP_KV_CACHE_MEMORY, (level, rank, a, b)
            llm.wake_up()
            assert not llm.is_sleeping()
            assert tokens() == before, level
    finally:
        llm.engine_core.shutdown()
    assert not wait_gone(pids, timeout_s=10)
