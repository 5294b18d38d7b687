"""What --otlp-traces-endpoint costs a request, and what it costs when off.

Three measurements of the shipped code:
- engine: the real Scheduler (tests/support/scheduler.py's fake model outputs) running
  --requests requests of 40 prompt tokens in 16-token chunks and 8 output tokens, traced
  (RequestTrace) or not: microseconds of scheduler time per request.
- api: the spans one traced request makes (the SERVER root from a traceparent, parse,
  tokenize, generate, queue_to_engine, five engine spans, detokenize_stream) through
  make_tracer's BatchSpanProcessor and OTLP/HTTP exporter: microseconds per request.
- serve: two `kvserve serve` of a tiny random Llama at once, one without the flag and one
  with it (spans to an OTLP receiver in this process), asked in turn --requests / 2
  sequential completions each (40 prompt tokens, 8 output tokens), over --rounds: median
  milliseconds per request of each.

    .venv/bin/python bench/tracing_cost.py [--requests 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import msgspec

from kvserve.services.api.observability.tracing import make_tracer
from kvserve.shared.messages import EngineSpan
from tests.support.models import TINY_KV_CACHE_MEMORY, TINY_VOCAB_SIZE, build_tiny_llama
from tests.support.scheduler import create_request, create_scheduler, step
from tests.support.server import serving

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class _Receiver:
    """An OTLP/HTTP endpoint that counts the bytes it was sent."""

    def __init__(self) -> None:
        self.num_bytes = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                receiver.num_bytes += len(self.rfile.read(int(self.headers["Content-Length"])))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"


def bench_engine(num_requests: int, traced: bool) -> float:
    scheduler = create_scheduler(max_num_batched_tokens=16 * 4)
    context = {"traceparent": TRACEPARENT} if traced else None
    for i in range(num_requests):
        request = create_request(f"r{i}", num_tokens=40, max_tokens=8)
        scheduler.add_request(msgspec.structs.replace(request, trace_context=context))
    start = time.perf_counter()
    while scheduler.has_requests():
        step(scheduler)
    return (time.perf_counter() - start) / num_requests * 1e6


def bench_api(num_requests: int, endpoint: str) -> float:
    tracer = make_tracer(endpoint)
    engine_spans = [EngineSpan("engine.waiting", 1, 2)]
    engine_spans += [EngineSpan("engine.prefill", 2, 3, {"position": 0, "num_tokens": 16})] * 3
    engine_spans += [EngineSpan("engine.decode", 3, 4, {"num_steps": 7})]
    seconds = 0.0
    for _ in range(num_requests // 100):
        # 100 requests' spans fit the processor's queue (2048); the export runs untimed.
        start = time.perf_counter()
        for _ in range(100):
            root = tracer.tracer.start_span(
                "POST /v1/completions", context=tracer.extract({"traceparent": TRACEPARENT})
            )
            for name in ("parse", "tokenize"):
                tracer.start_span(name, root).end()
            generate = tracer.start_span("generate", root, request_id="r")
            tracer.inject(generate)
            tracer.start_span("queue_to_engine", generate).end()
            tracer.add_engine_spans(generate, engine_spans, request_id="r")
            tracer.start_span("detokenize_stream", generate).end()
            generate.end()
            root.end()
        seconds += time.perf_counter() - start
        tracer.provider.force_flush()
    tracer.shutdown()
    return seconds / (num_requests // 100 * 100) * 1e6


def bench_serve(model_dir: str, num_requests: int, endpoint: str) -> dict[str, float]:
    """Two servers at once, one traced, asked in turn: load from elsewhere hits both alike."""
    base = [model_dir, "--kv-cache-memory", str(TINY_KV_CACHE_MEMORY)]
    base += ["--served-model-name", "tiny", "--max-num-batched-tokens", "16"]
    body = {"model": "tiny", "max_tokens": 8, "ignore_eos": True}
    latencies: dict[str, list[float]] = {"off": [], "on": []}
    with contextlib.ExitStack() as stack:
        urls = {}
        for key, flags in (("off", []), ("on", ["--otlp-traces-endpoint", endpoint])):
            log = stack.enter_context(tempfile.NamedTemporaryFile(suffix=".log"))
            urls[key] = stack.enter_context(serving(base + flags, log.name))
        clients = {
            key: stack.enter_context(httpx.Client(base_url=url, timeout=60))
            for key, url in urls.items()
        }
        for i in range(num_requests + 5):  # the first 5 warm up
            prompt = [(97 * i + j) % (TINY_VOCAB_SIZE - 5) + 5 for j in range(40)]
            for key in ("off", "on") if i % 2 else ("on", "off"):
                start = time.perf_counter()
                response = clients[key].post("/v1/completions", json=body | {"prompt": prompt})
                response.raise_for_status()
                if i >= 5:
                    latencies[key].append(time.perf_counter() - start)
    return {key: round(statistics.median(values) * 1e3, 2) for key, values in latencies.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    receiver = _Receiver()
    result: dict = {"engine_us_per_request": {}, "api_us_per_request": {}, "serve_ms": {}}
    for traced in (False, True, False, True):
        key = "on" if traced else "off"
        result["engine_us_per_request"].setdefault(key, []).append(
            round(bench_engine(args.requests, traced), 1)
        )
    result["api_us_per_request"]["on"] = round(bench_api(args.requests * 5, receiver.url), 1)
    model_dir = build_tiny_llama(tempfile.mkdtemp(prefix="tiny-llama-"))
    for _ in range(args.rounds):
        for key, ms in bench_serve(model_dir, args.requests // 2, receiver.url).items():
            result["serve_ms"].setdefault(key, []).append(ms)
    result["bytes_exported"] = receiver.num_bytes
    print(json.dumps(result))


if __name__ == "__main__":
    main()
