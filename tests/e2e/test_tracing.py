"""--otlp-traces-endpoint on a real `kvserve serve` (api and engine core processes), read by
an OTLP/HTTP receiver inside the test: one trace per request, the span tree of
services/api/observability/tracing.py with the engine's spans under the api's, and a client's W3C
traceparent kept as the root's parent.
"""

from __future__ import annotations

import os
from unittest import mock

import openai
import pytest

pytest.importorskip("opentelemetry.sdk", reason="kvserve[otel] is not installed")
from tests.support.models import TINY_KV_CACHE_MEMORY  # noqa: E402
from tests.support.otlp import Receiver  # noqa: E402
from tests.support.server import serving  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402

pytestmark = pytest.mark.slow  # a real server: ~20 s

MODEL = "tiny-traces"
CHUNK = 16  # --max-num-batched-tokens: a 40-token prompt prefills in 3 chunks
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
API_SPANS = {"parse", "tokenize", "generate"}
GENERATE_SPANS = {"queue_to_engine", "engine.waiting", "engine.prefill", "engine.decode"}


@pytest.fixture(scope="module")
def traced(tiny_llama_dir, tmp_path_factory):
    receiver = Receiver()
    log = str(tmp_path_factory.mktemp("logs") / "serve.log")
    args = [
        tiny_llama_dir,
        "--kv-cache-memory",
        str(TINY_KV_CACHE_MEMORY),
        "--served-model-name",
        MODEL,
        "--max-num-batched-tokens",
        str(CHUNK),
        "--otlp-traces-endpoint",
        receiver.url,
    ]
    # Export every 50 ms rather than OpenTelemetry's 5 s.
    with mock.patch.dict(os.environ, {"OTEL_BSP_SCHEDULE_DELAY": "50"}):
        with serving(args, log) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            yield client, receiver
    receiver.server.shutdown()


def finished_traces(receiver: Receiver, count: int) -> dict[str, list[dict]]:
    """The traces once `count` have their root (the span that ends last) exported."""

    def roots() -> dict[str, list[dict]]:
        return {
            trace_id: spans
            for trace_id, spans in receiver.traces().items()
            if any(span["name"].startswith("POST ") for span in spans)
        }

    assert wait_until(lambda: len(roots()) >= count), f"{count} traces were not exported"
    return roots()


def check_tree(spans: list[dict], route: str, num_prompt_tokens: int) -> dict:
    """The span tree of one request (services/api/observability/tracing.py); returns its root."""
    (root,) = [s for s in spans if s["parent_id"] not in {s["span_id"] for s in spans}]
    assert root["name"] == f"POST {route}"
    children = {s["name"] for s in spans if s["parent_id"] == root["span_id"]}
    assert children == API_SPANS
    (generate,) = [s for s in spans if s["name"] == "generate"]
    under_generate = [s for s in spans if s["parent_id"] == generate["span_id"]]
    assert {s["name"] for s in under_generate} == GENERATE_SPANS | {"detokenize_stream"}
    assert len(spans) == 1 + len(API_SPANS) + len(under_generate)
    # The engine's spans, timed in the engine core, in order inside the api's span.
    (waiting,) = [s for s in under_generate if s["name"] == "engine.waiting"]
    prefills = sorted(
        (s for s in under_generate if s["name"] == "engine.prefill"), key=lambda s: s["start"]
    )
    (decode,) = [s for s in under_generate if s["name"] == "engine.decode"]
    assert [p["attributes"]["position"].int_value for p in prefills] == list(
        range(0, num_prompt_tokens, CHUNK)
    )
    assert sum(p["attributes"]["num_tokens"].int_value for p in prefills) == num_prompt_tokens
    phases = [waiting, *prefills, decode]
    assert generate["start"] <= waiting["start"]
    for before, after in zip(phases, phases[1:]):
        assert before["end"] <= after["start"]
    assert decode["end"] <= generate["end"] <= root["end"]
    assert decode["attributes"]["num_steps"].int_value >= 1
    return root


def test_one_trace_per_request_with_engine_spans_and_client_parent(traced):
    client, receiver = traced
    prompt_ids = list(range(5, 45))  # 40 tokens: three prefill chunks of at most 16
    client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=4)
    # Streamed, and under the client's own trace.
    stream = client.completions.create(
        model=MODEL,
        prompt=list(range(100, 120)),  # nothing of it cached
        max_tokens=4,
        stream=True,
        extra_headers={"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"},
    )
    # Streamed to the end (a loaded server may send the 4 tokens in one chunk).
    chunks = list(stream)
    assert chunks and chunks[-1].choices[0].finish_reason == "length"
    traces = finished_traces(receiver, 2)
    assert len(traces) == 2, "one trace per request"

    streamed_spans = traces.pop(CLIENT_TRACE_ID)  # the client's trace id is kept
    (first_spans,) = traces.values()
    first_root = check_tree(first_spans, "/v1/completions", len(prompt_ids))
    assert first_root["parent_id"] == ""
    streamed_root = check_tree(streamed_spans, "/v1/completions", 20)
    assert streamed_root["parent_id"] == CLIENT_SPAN_ID
    assert streamed_root["attributes"]["http.response.status_code"].int_value == 200
