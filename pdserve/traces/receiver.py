"""An in-process OTLP trace receiver: gRPC TraceService/Export and HTTP/protobuf POST
/v1/traces, each span kept as a flat JSON-able dict and, given a file, appended to it as one
JSON line. `pdserve trace-collect` runs it; tests use it as their collector."""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

log = logging.getLogger(__name__)

KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
STATUS = {0: "unset", 1: "ok", 2: "error"}


def _value(any_value):
    """An OTLP AnyValue as a plain Python value."""
    which = any_value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    if which == "kvlist_value":
        return _attributes(any_value.kvlist_value.values)
    if which == "bytes_value":
        return any_value.bytes_value.hex()
    return getattr(any_value, which)


def _attributes(key_values) -> dict:
    return {kv.key: _value(kv.value) for kv in key_values}


def spans_of(request) -> list[dict]:
    """The spans of an ExportTraceServiceRequest, one dict each."""
    out = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                out.append({
                    "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                    "parent_span_id": span.parent_span_id.hex(), "name": span.name,
                    "kind": KINDS.get(span.kind, str(span.kind)),
                    "service.name": resource.get("service.name", ""),
                    "start_ns": span.start_time_unix_nano, "end_ns": span.end_time_unix_nano,
                    "attributes": _attributes(span.attributes),
                    "events": [{"name": e.name, "time_ns": e.time_unix_nano,
                                "attributes": _attributes(e.attributes)} for e in span.events],
                    "status": {"code": STATUS.get(span.status.code, str(span.status.code)),
                               "message": span.status.message},
                })
    return out


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


class TraceReceiver:
    """OTLP gRPC on `grpc_listen` (and HTTP on `http_listen` if given); port 0 picks a free
    one (`grpc_port` / `http_port` once started). Spans are kept (`spans()`) and, with `out`,
    appended to that file as JSON lines."""

    def __init__(self, grpc_listen: str | None = "127.0.0.1:0", http_listen: str | None = None,
                 out: str | Path | None = None) -> None:
        self._grpc_listen, self._http_listen = grpc_listen, http_listen
        self._out_path = Path(out) if out is not None else None
        self._lock = threading.Lock()
        self._spans: list[dict] = []
        self._out = None
        self._grpc = self._http = self._http_thread = None
        self.grpc_port = self.http_port = None

    def start(self) -> "TraceReceiver":
        if self._out_path is not None:
            self._out = self._out_path.open("a", encoding="utf-8")
        if self._grpc_listen is not None:
            self._start_grpc()
        if self._http_listen is not None:
            self._start_http()
        return self

    def _start_grpc(self) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import (trace_service_pb2,
                                                            trace_service_pb2_grpc)

        receiver = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                receiver.add(spans_of(request))
                return trace_service_pb2.ExportTraceServiceResponse()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), server)
        host, port = _split(self._grpc_listen)
        self.grpc_port = server.add_insecure_port(f"{host}:{port}")
        if not self.grpc_port:
            raise OSError(f"cannot listen on {self._grpc_listen} (OTLP gRPC)")
        server.start()
        self._grpc = server

    def _start_http(self) -> None:
        self._http = ThreadingHTTPServer(_split(self._http_listen), _handler(self))
        self.http_port = self._http.server_address[1]
        self._http_thread = threading.Thread(target=self._http.serve_forever,
                                             name="otlp-http", daemon=True)
        self._http_thread.start()

    def add(self, spans: list[dict]) -> None:
        with self._lock:
            self._spans.extend(spans)
            if self._out is not None:
                for span in spans:
                    self._out.write(json.dumps(span, sort_keys=True) + "\n")
                self._out.flush()

    def spans(self) -> list[dict]:
        with self._lock:
            return list(self._spans)

    def wait(self, count: int, timeout_s: float = 30.0) -> list[dict]:
        """The spans once at least `count` have arrived; TimeoutError after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.spans()
            if len(got) >= count:
                return got
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(got)} of {count} spans arrived in {timeout_s}s: "
                                   f"{sorted({s['name'] for s in got})}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self._grpc is not None:
            self._grpc.stop(grace=1).wait()
            self._grpc = None
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http_thread.join()
            self._http = None
        with self._lock:
            if self._out is not None:
                self._out.close()
                self._out = None

    def __enter__(self) -> "TraceReceiver":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _handler(receiver: TraceReceiver):
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            if self.path.split("?", 1)[0] != "/v1/traces":
                return self._reply(404, b"not found", "text/plain")
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if "gzip" in (self.headers.get("Content-Encoding") or ""):
                import gzip

                body = gzip.decompress(body)
            request = trace_service_pb2.ExportTraceServiceRequest()
            try:
                request.ParseFromString(body)
            except Exception:   # a body that is not the protobuf: the sender's fault
                return self._reply(400, b"not an ExportTraceServiceRequest", "text/plain")
            receiver.add(spans_of(request))
            self._reply(200, trace_service_pb2.ExportTraceServiceResponse().SerializeToString(),
                        "application/x-protobuf")

        def _reply(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):     # exports every half second: keep quiet
            log.debug(format, *args)

    return Handler


def main(args) -> int:
    # Ctrl-C and SIGTERM set an event, from before the receiver starts: a KeyboardInterrupt
    # raised between the ready line and the wait left the gRPC server's threads running and the
    # process alive (seen once in the suite).
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    receiver = TraceReceiver(args.listen, args.http_listen, args.out).start()
    where = [f"OTLP gRPC on {args.listen.rpartition(':')[0]}:{receiver.grpc_port}"]
    if receiver.http_port:
        where.append(f"HTTP on {args.http_listen.rpartition(':')[0]}:{receiver.http_port}"
                     "/v1/traces")
    try:
        print(f"collecting traces ({', '.join(where)}) into {args.out}; Ctrl-C stops",
              flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        receiver.stop()
    print(f"stopped: {len(receiver.spans())} spans written to {args.out}", flush=True)
    return 0
