"""The api's tracing helpers (services/api/observability/tracing.py): W3C trace context in and out,
the engine's phases as spans with their own times, and nothing at all when tracing is off."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("opentelemetry.sdk", reason="kvserve[otel] is not installed")
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

from kvserve.services.api.observability.tracing import (  # noqa: E402
    CURRENT_TRACER,
    PROTOCOL_ENV,
    ApiTracer,
    make_tracer,
    trace_span,
)
from kvserve.shared.api_config import FrontendConfig  # noqa: E402
from kvserve.shared.messages import EngineSpan  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN_ID = "00f067aa0ba902b7"


@pytest.fixture
def tracer_and_spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield ApiTracer(provider.get_tracer("test"), provider), exporter
    provider.shutdown()


def test_a_client_traceparent_is_the_parent_and_inject_names_our_span(tracer_and_spans):
    tracer, exporter = tracer_and_spans
    parent = tracer.extract({"traceparent": f"00-{TRACE_ID}-{SPAN_ID}-01"})
    root = tracer.tracer.start_span("POST /v1/completions", context=parent)
    child = tracer.start_span("generate", root, request_id="r")
    carrier = tracer.inject(child)
    ids = child.get_span_context()
    assert carrier["traceparent"] == f"00-{TRACE_ID}-{ids.span_id:016x}-01"
    child.end()
    root.end()
    by_name = {span.name: span for span in exporter.get_finished_spans()}
    assert f"{by_name['POST /v1/completions'].parent.span_id:016x}" == SPAN_ID
    assert f"{by_name['POST /v1/completions'].context.trace_id:032x}" == TRACE_ID
    assert by_name["generate"].parent.span_id == root.get_span_context().span_id
    assert dict(by_name["generate"].attributes) == {"request_id": "r"}


def test_without_traceparent_the_root_starts_a_new_trace(tracer_and_spans):
    tracer, exporter = tracer_and_spans
    tracer.tracer.start_span("POST /v1/completions", context=tracer.extract({})).end()
    (root,) = exporter.get_finished_spans()
    assert root.parent is None and root.context.trace_id != 0


def test_engine_spans_keep_the_engine_times_under_their_parent(tracer_and_spans):
    tracer, exporter = tracer_and_spans
    generate = tracer.start_span("generate")
    engine_spans = [
        EngineSpan("engine.waiting", 1_000, 2_000),
        EngineSpan("engine.prefill", 2_000, 5_000, {"position": 0, "num_tokens": 16}),
    ]
    tracer.add_engine_spans(generate, engine_spans, request_id="0_r")
    generate.end()
    spans = [s for s in exporter.get_finished_spans() if s.name.startswith("engine.")]
    assert [(s.name, s.start_time, s.end_time) for s in spans] == [
        ("engine.waiting", 1_000, 2_000),
        ("engine.prefill", 2_000, 5_000),
    ]
    assert dict(spans[1].attributes) == {"request_id": "0_r", "position": 0, "num_tokens": 16}
    assert {s.parent.span_id for s in spans} == {generate.get_span_context().span_id}


def test_trace_span_does_nothing_when_off_and_nests_when_on(tracer_and_spans):
    tracer, exporter = tracer_and_spans
    assert CURRENT_TRACER.get() is None
    with trace_span("parse") as span:
        assert span is None
    assert exporter.get_finished_spans() == ()
    token = CURRENT_TRACER.set(tracer)
    try:
        with tracer.span("root") as root, trace_span("parse"):
            pass
    finally:
        CURRENT_TRACER.reset(token)
    (parse,) = [s for s in exporter.get_finished_spans() if s.name == "parse"]
    assert parse.parent.span_id == root.get_span_context().span_id


def test_an_unknown_protocol_is_refused_by_name():
    with pytest.raises(ValueError, match="'http/json'"):
        make_tracer("http://127.0.0.1:1/v1/traces", protocol="http/json")


def test_both_exporters_are_built():
    for protocol in ("http/protobuf", "grpc"):
        make_tracer("http://127.0.0.1:1/v1/traces", protocol=protocol).shutdown()


def test_the_server_does_not_import_opentelemetry_until_asked():
    code = (
        "import sys, kvserve.services.api.server, kvserve.services.scheduler.engine.engine_core;"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_flag_is_checked_before_anything_starts(monkeypatch):
    FrontendConfig(otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces")
    with pytest.raises(ValueError, match="'127.0.0.1:4318'.*http/protobuf"):
        FrontendConfig(otlp_traces_endpoint="127.0.0.1:4318")
    monkeypatch.setenv(PROTOCOL_ENV, "grpc")
    FrontendConfig(otlp_traces_endpoint="grpc://127.0.0.1:4317")
    monkeypatch.setenv(PROTOCOL_ENV, "http/json")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json'"):
        FrontendConfig(otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces")


def test_spans_reach_an_otlp_grpc_collector(monkeypatch):
    """OTLP over gRPC (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc) into a collector in the test;
    the e2e test covers OTLP/HTTP through a real server."""
    from concurrent import futures

    grpc = pytest.importorskip("grpc")
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received: list[str] = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 - the service's name
            received.extend(
                span.name
                for resource_spans in request.resource_spans
                for scope_spans in resource_spans.scope_spans
                for span in scope_spans.spans
            )
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        monkeypatch.setenv(PROTOCOL_ENV, "grpc")
        tracer = make_tracer(f"http://127.0.0.1:{port}")
        root = tracer.start_span("POST /v1/completions")
        tracer.add_engine_spans(root, [EngineSpan("engine.prefill", 1, 2)])
        root.end()
        tracer.shutdown()  # exports what the batch holds
    finally:
        server.stop(None)
    assert sorted(received) == ["POST /v1/completions", "engine.prefill"]
