"""DP routing by TTFT target, end to end: `kvserve serve --data-parallel-size 2` of the tiny
model. One engine prefills a long prompt in small chunks (its predicted queue delay is long),
the other is idle. A burst of short requests with a TTFT target all go to the idle engine,
where vLLM's score rule would split them (after the first, the idle engine's score is the
higher); which engine served what is read from the per-engine /metrics series.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import threading
import time

import openai
import pytest

from tests.support.metrics import metrics_text, read_metric
from tests.support.server import DP_MODEL_NAME, ServeProcess, start_dp_front_end
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

LONG_PROMPT = [65 + i % 26 for i in range(6000)]  # 1,500 steps of 4 tokens to prefill
TARGETED_PROMPT = [67] * 20
NUM_TARGETED = 4
TTFT_TARGET_MS = 150.0


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("slo-routing")
    model_dir = folder / "model"
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 8192}))
    server = start_dp_front_end(
        str(model_dir), folder, "--max-model-len", "8192", "--max-num-batched-tokens", "4"
    )
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def _complete(server: ServeProcess, prompt: list[int], max_tokens: int, **kwargs):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    return client.completions.create(
        model=DP_MODEL_NAME,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
        **kwargs,
    )


def _running(server: ServeProcess) -> list[float]:
    text = metrics_text(server.url)
    return [read_metric(text, "kvserve:num_requests_running", engine=str(i)) for i in (0, 1)]


def test_targeted_requests_go_to_the_engine_predicted_to_meet_their_ttft(server):
    long_done = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1 + NUM_TARGETED) as pool:
        long_future = pool.submit(_complete, server, LONG_PROMPT, 1)
        long_future.add_done_callback(lambda _: long_done.set())
        # The long prompt is running on its engine, and that engine has reported since (its
        # stats ride its outputs; the load reports go every 50 ms, the tables every 100 ms).
        running: list[float] = []

        def one_running() -> bool:
            running[:] = _running(server)
            return sum(running) == 1

        assert wait_until(one_running, timeout_s=60), running
        long_engine = running.index(1.0)
        time.sleep(0.3)  # a load table with its predicted delay reaches the api
        targeted = [
            pool.submit(
                _complete,
                server,
                TARGETED_PROMPT,
                2,
                extra_headers={"x-slo-ttft-ms": str(TTFT_TARGET_MS)},
            )
            for _ in range(NUM_TARGETED)
        ]
        for future in targeted:
            future.result()
        burst_beside_long = not long_done.is_set()
        long_future.result()
    text = metrics_text(server.url)
    prompt_tokens = [
        read_metric(text, "kvserve:prompt_tokens_total", engine=str(i)) for i in (0, 1)
    ]
    served = [
        read_metric(text, "kvserve:request_success_total", engine=str(i), finished_reason="length")
        for i in (0, 1)
    ]
    other = 1 - long_engine
    # The long prompt alone on its engine; every targeted request on the other.
    assert prompt_tokens[long_engine] == len(LONG_PROMPT), (prompt_tokens, server.log()[-3000:])
    assert served == [1, NUM_TARGETED][:: 1 if long_engine == 0 else -1], served
    assert prompt_tokens[other] == NUM_TARGETED * len(TARGETED_PROMPT)
    # The premise: the long prompt was still prefilling while the burst was served.
    assert burst_beside_long, "the long prompt finished before the targeted burst"
