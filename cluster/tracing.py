"""OpenTelemetry tracing of requests across the gateway and the workers (torch-free).

Off unless an OTLP endpoint is set (`--otlp-traces-endpoint`, else the OpenTelemetry
environment: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT, their _PROTOCOL
twins, OTEL_SERVICE_NAME, OTEL_SDK_DISABLED). Off costs nothing: `Tracing.off()` imports no SDK,
creates no span and parses no header, and callers skip their own recording when
`tracing.enabled` is false.

The trace context travels as W3C `traceparent` / `tracestate`: the gateway takes it from a
client's HTTP headers or gRPC metadata (or starts a trace), and passes it to the workers in the
metadata of their RPCs. Workers build their spans after the fact from the times their engine
recorded (`record`), so nothing runs per engine step.

Each process owns its tracer provider (no global provider is set): tests run several in one
process, each exporting to its own collector.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

PROTOCOLS = ("grpc", "http/protobuf")
TRACE_HEADERS = ("traceparent", "tracestate")

# Attribute names: OpenTelemetry's gen_ai semantic conventions where one exists (the ones vLLM
# records too), else ours under pdserve.*
GEN_AI_REQUEST_ID = "gen_ai.request.id"
GEN_AI_MODEL = "gen_ai.request.model"
GEN_AI_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_TOP_P = "gen_ai.request.top_p"
GEN_AI_N = "gen_ai.request.n"
GEN_AI_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
GEN_AI_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
GEN_AI_TTFT = "gen_ai.latency.time_to_first_token"
GEN_AI_E2E = "gen_ai.latency.e2e"
GEN_AI_TIME_IN_PREFILL = "gen_ai.latency.time_in_model_prefill"
GEN_AI_TIME_IN_DECODE = "gen_ai.latency.time_in_model_decode"


@dataclass(frozen=True)
class TracingSettings:
    """Where spans go. endpoint None: tracing is off."""

    endpoint: str | None = None
    protocol: str = "grpc"
    service_name: str = "pdserve"
    insecure: bool = True           # grpc: plaintext unless the endpoint is https://

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"OTLP protocol {self.protocol!r} is not supported: use one of "
                             f"{', '.join(PROTOCOLS)} (--otlp-traces-protocol)")
        if self.endpoint is not None:
            parts = urlsplit(self.endpoint if "://" in self.endpoint
                             else "http://" + self.endpoint)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"OTLP endpoint {self.endpoint!r} is not a URL like "
                                 "http://collector:4317 (--otlp-traces-endpoint)")

    @classmethod
    def from_sources(cls, endpoint: str | None, protocol: str | None, service_name: str,
                     environ: Mapping[str, str] = os.environ) -> "TracingSettings":
        """The flags first, then OpenTelemetry's environment variables."""
        if environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
            return cls(service_name=service_name)
        endpoint = (endpoint or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                    or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None)
        protocol = (protocol or environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                    or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
        name = environ.get("OTEL_SERVICE_NAME") or service_name
        insecure = not (endpoint or "").startswith("https://")
        return cls(endpoint, protocol, name, insecure)


class Span:
    """A live span (or nothing when tracing is off): set attributes, add events, end."""

    __slots__ = ("_span",)

    def __init__(self, span=None) -> None:
        self._span = span

    def __bool__(self) -> bool:
        return self._span is not None

    def set(self, key: str, value) -> None:
        if self._span is not None and value is not None:
            self._span.set_attribute(key, value)

    def set_many(self, attributes: Mapping[str, object]) -> None:
        for key, value in attributes.items():
            self.set(key, value)

    def event(self, name: str, attributes: Mapping[str, object] | None = None,
              time_ns: int | None = None) -> None:
        if self._span is not None:
            self._span.add_event(name, _clean(attributes or {}), timestamp=time_ns)

    def error(self, message: str) -> None:
        if self._span is not None:
            from opentelemetry.trace import Status, StatusCode

            self._span.set_status(Status(StatusCode.ERROR, message))

    def end(self, time_ns: int | None = None) -> None:
        if self._span is not None:
            self._span.end(end_time=time_ns)
            self._span = None

    def context(self):
        """This span as a parent context (None when off)."""
        if self._span is None:
            return None
        from opentelemetry import trace

        return trace.set_span_in_context(self._span)

    def headers(self) -> list[tuple[str, str]]:
        """W3C trace context of this span, as gRPC metadata / HTTP headers ([] when off)."""
        if self._span is None:
            return []
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, context=self.context())
        return sorted(carrier.items())

    @property
    def trace_id(self) -> str:
        """32 hex digits ('' when off)."""
        if self._span is None:
            return ""
        return format(self._span.get_span_context().trace_id, "032x")


NO_SPAN = Span()


@dataclass(frozen=True)
class Phase:
    """A span to record after the fact: a name, start and end in epoch ns, attributes, events
    (name, epoch ns, attributes), and child phases."""

    name: str
    start_ns: int
    end_ns: int
    attributes: Mapping[str, object] = None
    events: Sequence[tuple[str, int, Mapping[str, object]]] = ()
    children: Sequence["Phase"] = ()
    error: str = ""


class Tracing:
    """One process's tracer, or nothing (`Tracing.off()`)."""

    def __init__(self, settings: TracingSettings, exporter=None) -> None:
        """`exporter`: a span exporter used instead of OTLP (on even without an endpoint),
        each span handed over as it ends: e.g. the SDK's InMemorySpanExporter in tests."""
        self.settings = settings
        self._provider = None
        self._tracer = None
        self._propagator = None
        if settings.endpoint is None and exporter is None:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        provider = TracerProvider(resource=Resource.create(
            {"service.name": settings.service_name}))
        if exporter is not None:
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        else:
            provider.add_span_processor(BatchSpanProcessor(_exporter(settings),
                                                           schedule_delay_millis=500))
        self._provider = provider
        self._tracer = provider.get_tracer("pdserve")
        self._propagator = TraceContextTextMapPropagator()
        log.info("tracing on: %s as service %r", f"OTLP {settings.protocol} to "
                 f"{settings.endpoint}" if exporter is None else "a given exporter",
                 settings.service_name)

    @classmethod
    def off(cls) -> "Tracing":
        return cls(TracingSettings())

    @classmethod
    def from_args(cls, args, service_name: str) -> "Tracing":
        return cls(TracingSettings.from_sources(getattr(args, "otlp_traces_endpoint", None),
                                                getattr(args, "otlp_traces_protocol", None),
                                                service_name))

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def extract(self, carrier: Mapping[str, str] | Iterable[tuple[str, str]]):
        """The parent context in W3C headers / gRPC metadata (None when off, or none sent or
        it does not parse)."""
        if self._propagator is None:
            return None
        items = carrier.items() if isinstance(carrier, Mapping) else carrier
        found = {k.lower(): v for k, v in items if k.lower() in TRACE_HEADERS}
        if "traceparent" not in found:
            return None
        from opentelemetry import trace

        ctx = self._propagator.extract(found)
        return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None

    def start(self, name: str, parent=None, kind: str = "internal",
              attributes: Mapping[str, object] | None = None,
              start_ns: int | None = None) -> Span:
        """A live span, child of `parent` (a context from `extract` or `Span.context()`; None
        starts a trace). NO_SPAN when off."""
        if self._tracer is None:
            return NO_SPAN
        from opentelemetry.trace import SpanKind

        span = self._tracer.start_span(name, context=parent, kind=getattr(SpanKind, kind.upper()),
                                       attributes=_clean(attributes or {}), start_time=start_ns)
        return Span(span)

    def record(self, phase: Phase, parent, kind: str = "internal") -> None:
        """Emit `phase` and its children as spans under `parent`, with their recorded times."""
        if self._tracer is None:
            return
        span = self.start(phase.name, parent, kind, phase.attributes, phase.start_ns)
        for name, at_ns, attrs in phase.events:
            span.event(name, attrs, at_ns)
        for child in phase.children:
            self.record(child, span.context())
        if phase.error:
            span.error(phase.error)
        span.end(max(phase.end_ns, phase.start_ns))

    def shutdown(self) -> None:
        """Send what is buffered and stop (the process is ending)."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = self._tracer = None

    def flush(self, timeout_ms: int = 5000) -> bool:
        return self._provider.force_flush(timeout_ms) if self._provider is not None else True


def _exporter(settings: TracingSettings):
    endpoint = settings.endpoint
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        target = endpoint.split("://", 1)[-1].rstrip("/")
        return OTLPSpanExporter(endpoint=target, insecure=settings.insecure)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    url = endpoint if "://" in endpoint else "http://" + endpoint
    if urlsplit(url).path in ("", "/"):
        url = url.rstrip("/") + "/v1/traces"
    return OTLPSpanExporter(endpoint=url)


def _clean(attributes: Mapping[str, object]) -> dict:
    """OpenTelemetry takes str, bool, int, float and sequences of one of them; None is left out."""
    out = {}
    for key, value in attributes.items():
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            value = [v for v in value if v is not None]
        out[key] = value
    return out

