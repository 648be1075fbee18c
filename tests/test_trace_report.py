"""pdserve trace-collect's receiver takes spans from the real OpenTelemetry OTLP exporters that
cluster.tracing sets up (gRPC and HTTP/protobuf), and trace-report's numbers over them are the
known durations' percentiles; both commands run as processes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.tracing import GEN_AI_E2E, GEN_AI_TTFT, Phase, Tracing, TracingSettings
from pdserve.traces import report
from pdserve.traces.receiver import TraceReceiver

ROOT = Path(__file__).resolve().parent.parent
MS = 1_000_000
N = 11                  # requests k = 1..N: TTFT k ms, prefill.compute 2k ms, e2e 10k ms


def _request(gateway: Tracing, prefill: Tracing, k: int, base: int) -> None:
    """One request's spans: the gateway's root and phases (the gateway's process), the prefill
    worker's under the trace context the gateway would send it (the worker's process)."""
    root = gateway.start("pdserve.request", kind="server", start_ns=base,
                         attributes={GEN_AI_TTFT: k / 1e3, GEN_AI_E2E: 10 * k / 1e3})
    gateway.record(Phase("gateway.tokenize", base, base + k * MS // 10), root.context())
    parent = prefill.extract(root.headers())
    assert parent is not None
    start = base + MS
    prefill.record(Phase("prefill.request", start, start + 3 * k * MS,
                         children=[Phase("prefill.queue", start, start + k * MS),
                                   Phase("prefill.compute", start + k * MS, start + 3 * k * MS,
                                         events=[("chunk", start + 2 * k * MS,
                                                  {"tokens": 16})])]),
                   parent, kind="server")
    root.end(base + 10 * k * MS)


@pytest.fixture(scope="module")
def spans(tmp_path_factory):
    out = tmp_path_factory.mktemp("traces") / "traces.jsonl"
    with TraceReceiver("127.0.0.1:0", "127.0.0.1:0", out) as receiver:
        gateway = Tracing(TracingSettings(f"http://127.0.0.1:{receiver.grpc_port}", "grpc",
                                          "pdserve-gateway"))
        prefill = Tracing(TracingSettings(f"http://127.0.0.1:{receiver.http_port}",
                                          "http/protobuf", "pdserve-prefill"))
        base = time.time_ns()
        for k in range(1, N + 1):
            _request(gateway, prefill, k, base + k * 1000 * MS)
        assert gateway.flush() and prefill.flush()
        gateway.shutdown()
        prefill.shutdown()
        got = receiver.wait(5 * N, timeout_s=30)
    assert len(got) == 5 * N, [s["name"] for s in got]
    assert report.load(out) == got                   # the file holds what was received
    return out, got


def test_spans_arrive_over_both_protocols_with_their_links(spans):
    _, got = spans
    by_service = {}
    for span in got:
        by_service.setdefault(span["service.name"], set()).add(span["name"])
    assert by_service == {"pdserve-gateway": {"pdserve.request", "gateway.tokenize"},
                          "pdserve-prefill": {"prefill.request", "prefill.queue",
                                              "prefill.compute"}}
    ids = {s["span_id"]: s for s in got}
    for span in got:
        if span["name"] == "pdserve.request":
            assert span["parent_span_id"] == "" and span["kind"] == "server"
            assert span["attributes"][GEN_AI_TTFT] > 0
            continue
        parent = ids[span["parent_span_id"]]           # every other span's parent arrived
        assert parent["trace_id"] == span["trace_id"]
    compute = next(s for s in got if s["name"] == "prefill.compute")
    assert compute["events"][0]["name"] == "chunk"
    assert compute["events"][0]["attributes"] == {"tokens": 16}
    assert len({s["trace_id"] for s in got}) == N


def test_report_percentiles_are_the_known_durations(spans):
    _, got = spans
    summary = report.summarize(got, slowest=3)
    assert (summary["requests"], summary["traces"], summary["errors"]) == (N, N, 0)
    rows = {row["phase"]: row for row in summary["phases"]}
    # k = 1..11: p50 is the 6th, p90 the 10th, p99 90% of the way from the 10th to the 11th
    for phase, unit in (("ttft", 1e-3), ("prefill.compute", 2e-3), ("prefill.queue", 1e-3),
                        ("pdserve.request", 10e-3), ("e2e", 10e-3), ("gateway.tokenize", 1e-4)):
        row = rows[phase]
        assert row["count"] == N, phase
        assert row["p50"] == pytest.approx(6 * unit, rel=1e-9), phase
        assert row["p90"] == pytest.approx(10 * unit, rel=1e-9), phase
        assert row["p99"] == pytest.approx(10.9 * unit, rel=1e-9), phase
    slow = summary["slowest"]
    assert [r["ttft"] for r in slow] == [0.011, 0.010, 0.009]
    assert slow[0]["phases"]["prefill.compute"] == pytest.approx(0.022, rel=1e-9)


def _span(span_id: str, parent: str, name: str, ms: int) -> dict:
    return {"trace_id": "ab" * 16, "span_id": span_id, "parent_span_id": parent, "name": name,
            "start_ns": 0, "end_ns": ms * MS, "attributes": {}, "status": {"code": "unset"}}


def test_a_client_trace_holding_two_requests_is_two_requests():
    spans = [_span("c0", "", "client", 100),
             _span("r1", "c0", "pdserve.request", 30), _span("q1", "r1", "prefill.queue", 5),
             _span("r2", "c0", "pdserve.request", 60), _span("q2", "r2", "prefill.queue", 7),
             _span("x", "gone", "prefill.queue", 9)]     # its parent never arrived: no request
    summary = report.summarize(spans)
    assert (summary["traces"], summary["requests"]) == (1, 2)
    got = sorted((r["phases"]["pdserve.request"], r["phases"]["prefill.queue"])
                 for r in summary["slowest"])
    assert got == [(0.03, 0.005), (0.06, 0.007)]
    assert "client" not in {row["phase"] for row in summary["phases"]}


def test_percentile_interpolates():
    assert report.percentile([3.0], 0.99) == 3.0
    assert report.percentile([1.0, 2.0], 0.5) == 1.5
    assert report.percentile([4.0, 1.0, 3.0, 2.0], 0.0) == 1.0


def _pdserve(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_commands_help():
    for command in ("trace-collect", "trace-report"):
        done = _pdserve(command, "--help")
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"usage: pdserve {command}")


def test_report_command_on_the_file(spans, tmp_path):
    out, _ = spans
    png = tmp_path / "slow.png"
    done = _pdserve("trace-report", str(out), "--plot", str(png), "--slowest", "2")
    assert done.returncode == 0, done.stderr
    assert f"{N} requests (0 failed)" in done.stdout
    ttft = next(line for line in done.stdout.splitlines() if line.startswith("ttft "))
    assert ttft.split()[1:] == [str(N), "6.00", "10.00", "10.90"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    done = _pdserve("trace-report", str(out), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["requests"] == N


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_collect_command_writes_and_stops_on_ctrl_c_or_sigterm(tmp_path, signum):
    import signal
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "t.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "trace-collect", "--listen",
                             f"127.0.0.1:{port}", "--out", str(out)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "collecting traces" in proc.stdout.readline()
        tracing = Tracing(TracingSettings(f"http://127.0.0.1:{port}", "grpc", "pdserve-test"))
        now = time.time_ns()
        tracing.record(Phase("pdserve.request", now, now + 5 * MS), None, kind="server")
        assert tracing.flush()
        tracing.shutdown()
        deadline = time.monotonic() + 30
        while not (out.exists() and out.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        proc.send_signal(getattr(signal, signum))
        stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert "stopped: 1 spans" in stdout
    [span] = report.load(out)
    assert span["name"] == "pdserve.request" and span["service.name"] == "pdserve-test"
    assert span["end_ns"] - span["start_ns"] == 5 * MS
