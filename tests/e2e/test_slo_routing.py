"""DP routing by TTFT target, end to end: `kvserve serve --data-parallel-size 2` of the tiny
model. One engine prefills a long prompt (its predicted queue delay is long), the other
streams a decode (as loaded by vLLM's score: one running request each). A burst of short
requests with a TTFT target all go to the engine predicted to meet it, where the score rule
would split them; which engine served what is read from the per-engine /metrics series.
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

pytestmark = pytest.mark.slow

LONG_PROMPT = [65 + i % 26 for i in range(6000)]  # ~190 steps of 32 tokens to prefill
DECODE_PROMPT = [66] * 10
TARGETED_PROMPT = [67] * 20
NUM_TARGETED = 4
TTFT_TARGET_MS = 50.0


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("slo-routing")
    model_dir = folder / "model"
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 8192}))
    server = start_dp_front_end(
        str(model_dir), folder, "--max-model-len", "8192", "--max-num-batched-tokens", "32"
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


def test_targeted_requests_go_to_the_engine_predicted_to_meet_their_ttft(server):
    long_done = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(2 + NUM_TARGETED) as pool:
        # The long prompt goes to one engine; the decode, sent once it is routed, to the
        # other (the first engine's score is higher by then).
        long_future = pool.submit(_complete, server, LONG_PROMPT, 1)
        long_future.add_done_callback(lambda _: long_done.set())
        time.sleep(0.3)
        decode_future = pool.submit(_complete, server, DECODE_PROMPT, 400)
        time.sleep(0.4)  # load tables with both engines busy reach the api (every 0.1 s)
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
        # The premise: the long prompt was still prefilling while the burst was served.
        assert not long_done.is_set(), "the long prompt finished before the targeted burst"
        long_future.result()
        decode_future.result()
    text = metrics_text(server.url)
    prompt_tokens = [
        read_metric(text, "kvserve:prompt_tokens_total", engine=str(i)) for i in (0, 1)
    ]
    served = [
        read_metric(text, "kvserve:request_success_total", engine=str(i), finished_reason="length")
        for i in (0, 1)
    ]
    long_engine = 0 if prompt_tokens[0] >= len(LONG_PROMPT) else 1
    other = 1 - long_engine
    # The long prompt alone on its engine; the decode and every targeted request on the other.
    assert prompt_tokens[long_engine] == len(LONG_PROMPT), prompt_tokens
    assert served[long_engine] == 1, served
    assert prompt_tokens[other] == len(DECODE_PROMPT) + NUM_TARGETED * len(TARGETED_PROMPT)
    assert served[other] == 1 + NUM_TARGETED, served
