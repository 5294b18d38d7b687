"""--otlp-traces-endpoint: one OpenTelemetry trace per request, exported over OTLP.

    client ──traceparent──▶ POST /v1/...          (TracingMiddleware; SERVER span, the
                              ├── parse            client's span as its parent)
                              ├── tokenize
                              └── generate         (one per prompt: EngineClient.generate)
                                    ├── queue_to_engine
                                    ├── engine.waiting     ┐ timed in the engine core
                                    ├── engine.prefill ×N  │ (scheduler/core/request_trace.py),
                                    ├── engine.decode      ┘ sent back in its last output
                                    └── detokenize_stream  (first output to the last)

The engine's phases come back as EngineSpans with wall-clock times and become spans here,
under the context the request carried to the engine (EngineCoreRequest.trace_context), as
vLLM does: one exporter, in the api, and nothing to flush in the engine processes.

Off by default and free when off: OpenTelemetry is imported only by `make_tracer`, the
middleware is not installed, CURRENT_TRACER stays None, and every hook is one `is None`.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.shared.messages import EngineSpan

# The tracer of the HTTP request being served; None when tracing is off or outside a request.
CURRENT_TRACER: ContextVar[ApiTracer | None] = ContextVar("kvserve_tracer", default=None)

PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"  # OpenTelemetry's own variable
PROTOCOLS = ("http/protobuf", "grpc")
_EXPORTER_PACKAGES = {"http/protobuf": "http", "grpc": "grpc"}


class ApiTracer:
    """The api's OpenTelemetry tracer and the few operations kvserve needs of it."""

    def __init__(self, tracer: Any, provider: Any):
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.tracer = tracer
        self.provider = provider
        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()

    def extract(self, carrier: dict[str, str]) -> Any:
        """The context a client's `traceparent` (and `tracestate`) names; empty without."""
        return self._propagator.extract(carrier)

    def inject(self, span: Any) -> dict[str, str]:
        """`span`'s W3C trace context, as the engine request carries it."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, self._trace.set_span_in_context(span))
        return carrier

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[Any]:
        """A span under the current one, current while the block runs (sync code only)."""
        with self.tracer.start_as_current_span(name) as span:
            yield span

    def start_span(self, name: str, parent: Any = None, **attributes: Any) -> Any:
        """A span under `parent` (None: the current span), not made current: for async
        generators, which may resume in another context. The caller ends it."""
        context = None if parent is None else self._trace.set_span_in_context(parent)
        return self.tracer.start_span(name, context=context, attributes=attributes)

    def add_engine_spans(self, parent: Any, spans: list[EngineSpan], **attributes: Any) -> None:
        """The engine core's phases of one request, as spans under `parent`."""
        context = self._trace.set_span_in_context(parent)
        for engine_span in spans:
            span = self.tracer.start_span(
                engine_span.name,
                context=context,
                start_time=engine_span.start_ns,
                attributes={**attributes, **engine_span.attributes},
            )
            span.end(end_time=engine_span.end_ns)

    def add_span(
        self, name: str, carrier: dict[str, str], start_ns: int, end_ns: int, **attributes: Any
    ) -> None:
        """A finished span under the context an engine request carries (`carrier`)."""
        span = self.tracer.start_span(
            name, context=self.extract(carrier), start_time=start_ns, attributes=attributes
        )
        span.end(end_time=end_ns)

    def shutdown(self) -> None:
        """Export what is still buffered."""
        self.provider.shutdown()


def make_tracer(endpoint: str, protocol: str | None = None) -> ApiTracer:
    """A tracer exporting to `endpoint` in batches (BatchSpanProcessor).

    Args:
        protocol: "http/protobuf" (default; the endpoint is the full URL, e.g.
            http://collector:4318/v1/traces) or "grpc" (e.g. http://collector:4317); None
            reads OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, as vLLM does.
    """
    protocol = protocol or os.environ.get(PROTOCOL_ENV) or "http/protobuf"
    if protocol not in PROTOCOLS:
        raise ValueError(f"{PROTOCOL_ENV}={protocol!r}: kvserve exports OTLP over {PROTOCOLS}")
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        exporter_module = importlib.import_module(
            f"opentelemetry.exporter.otlp.proto.{_EXPORTER_PACKAGES[protocol]}.trace_exporter"
        )
    except ImportError as exc:
        extra = "opentelemetry-exporter-otlp-proto-grpc" if protocol == "grpc" else "kvserve[otel]"
        raise ValueError(
            f"--otlp-traces-endpoint needs OpenTelemetry's SDK and OTLP exporter "
            f"(pip install {extra}): {exc}"
        ) from None
    provider = TracerProvider(resource=Resource.create({"service.name": "kvserve"}))
    exporter = exporter_module.OTLPSpanExporter(endpoint=endpoint)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    global _PROCESS_TRACER
    _PROCESS_TRACER = ApiTracer(provider.get_tracer("kvserve"), provider)
    return _PROCESS_TRACER


# The api process's tracer (None: tracing off), for work that runs outside a request's
# context: a migration, started by the engine liveness watcher.
_PROCESS_TRACER: ApiTracer | None = None


def process_tracer() -> ApiTracer | None:
    return _PROCESS_TRACER


class TracingMiddleware:
    """A SERVER span over each POST (the API's requests), the client's traceparent as its
    parent; the handler below finds the tracer in CURRENT_TRACER."""

    def __init__(self, app: ASGIApp, tracer: ApiTracer):
        self.app = app
        self.tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        carrier = {
            key.decode("latin-1"): value.decode("latin-1")
            for key, value in scope["headers"]
            if key in (b"traceparent", b"tracestate")
        }
        from opentelemetry.trace import SpanKind, Status, StatusCode

        name = f"POST {scope['path']}"
        span = self.tracer.tracer.start_span(
            name,
            context=self.tracer.extract(carrier),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "url.path": scope["path"]},
        )

        async def send_with_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
            await send(message)

        token = CURRENT_TRACER.set(self.tracer)
        # The root span is current for the handler's synchronous spans (parse, tokenize).
        context_token = _attach(self.tracer, span)
        try:
            await self.app(scope, receive, send_with_status)
        finally:
            _detach(context_token)
            CURRENT_TRACER.reset(token)
            span.end()


def _attach(tracer: ApiTracer, span: Any) -> Any:
    from opentelemetry import context

    return context.attach(tracer._trace.set_span_in_context(span))


def _detach(token: Any) -> None:
    from opentelemetry import context

    context.detach(token)


def trace_span(name: str) -> contextlib.AbstractContextManager:
    """A span under the request's current span while the block runs; nothing when off."""
    tracer = CURRENT_TRACER.get()
    return contextlib.nullcontext() if tracer is None else tracer.span(name)
