"""`pdserve trace-collect` (a small OTLP trace receiver writing one JSON span per line) and
`pdserve trace-report` (where a run's requests spent their time, from that file). Registering
the commands imports nothing heavy: grpc and matplotlib load when a command runs."""

from __future__ import annotations


def register(sub) -> None:
    collect = sub.add_parser(
        "trace-collect", help="receive OTLP traces and write them as JSON lines",
        description="A small OpenTelemetry collector for pdserve's traces: takes OTLP over gRPC "
                    "(TraceService/Export) and, with --http-listen, OTLP HTTP/protobuf "
                    "(POST /v1/traces), and appends one JSON object per span to --out. Point "
                    "every process at it with --otlp-traces-endpoint http://HOST:PORT. Ctrl-C "
                    "stops it.")
    collect.add_argument("--listen", default="127.0.0.1:4317", metavar="HOST:PORT",
                         help="OTLP gRPC address (default: %(default)s)")
    collect.add_argument("--http-listen", default=None, metavar="HOST:PORT",
                         help="also take OTLP HTTP/protobuf here, e.g. 127.0.0.1:4318")
    collect.add_argument("--out", default="traces.jsonl", help="JSON lines file, appended to "
                                                               "(default: %(default)s)")
    collect.set_defaults(target="pdserve.traces.receiver:main")

    report = sub.add_parser(
        "trace-report", help="per-phase latency percentiles and the slowest requests",
        description="Read a trace-collect file: per-phase p50/p90/p99 over the requests (the "
                    "gateway's pdserve.request spans), TTFT and end-to-end latency, and the "
                    "slowest requests by TTFT broken down by phase.")
    report.add_argument("file", help="JSON lines written by pdserve trace-collect")
    report.add_argument("--slowest", type=int, default=5, metavar="N",
                        help="how many of the slowest requests to break down (default: 5)")
    report.add_argument("--plot", default=None, metavar="PNG",
                        help="write a stacked bar per slow request to this image")
    report.add_argument("--json", action="store_true", help="print the report as JSON")
    report.set_defaults(target="pdserve.traces.report:main")
