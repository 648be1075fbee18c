"""One request through a real three-process stack (gateway, prefill and decode workers, Redis)
with tracing on, exported to an in-process OTLP receiver (the gateway over gRPC, the workers
over HTTP/protobuf): one trace, the client's; parent links across the processes; durations that
add up to what the client measured; the timing block agreeing with the spans."""

from __future__ import annotations

import time

import httpx
import pytest

from pdserve.traces.receiver import TraceReceiver
from tests.stack import standard_stack
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
WORKER_ROOTS = ("prefill.request", "decode.request")


@pytest.fixture(scope="module")
def traced(model_dir, tmp_path_factory):
    with TraceReceiver(grpc_listen="127.0.0.1:0", http_listen="127.0.0.1:0") as receiver:
        workers = ("--otlp-traces-endpoint", f"http://127.0.0.1:{receiver.http_port}",
                   "--otlp-traces-protocol", "http/protobuf")
        gateway = ("--otlp-traces-endpoint", f"http://127.0.0.1:{receiver.grpc_port}")
        with standard_stack(model_dir, tmp_path_factory.mktemp("traced"), decode_args=workers,
                            prefill_args=workers, gateway_args=gateway) as stack:
            yield stack, receiver


def _completion(stack, **extra):
    body = {"prompt": "The capital of France is " * 12, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, **extra}
    headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
    t0 = time.perf_counter()
    r = httpx.post(stack.procs[-1].http + "/v1/completions", json=body, headers=headers,
                   timeout=120)
    return r, time.perf_counter() - t0


def _by_name(spans):
    out: dict[str, list[dict]] = {}
    for s in spans:
        out.setdefault(s["name"], []).append(s)
    return out


def test_one_trace_across_three_processes(traced):
    stack, receiver = traced
    r, latency = _completion(stack, nvext={"extra_fields": ["timing", "worker_id"]})
    assert r.status_code == 200, r.text
    wait_until(lambda: all(n in _by_name(receiver.spans()) for n in
                           ("pdserve.request", *WORKER_ROOTS)), 30,
               lambda: f"spans of every process (have {sorted(_by_name(receiver.spans()))})")
    spans = receiver.spans()
    assert {s["trace_id"] for s in spans} == {CLIENT_TRACE}
    names = _by_name(spans)
    ids = {s["span_id"]: s for s in spans}
    root, = names["pdserve.request"]
    assert root["parent_span_id"] == CLIENT_SPAN and root["kind"] == "server"
    assert root["service.name"] == "pdserve-gateway"
    for worker_root, client in (("prefill.request", "gateway.prefill"),
                                ("decode.request", "gateway.decode")):
        span, = names[worker_root]
        parent = ids[span["parent_span_id"]]
        assert parent["name"] == client and parent["kind"] == "client"
        assert parent["service.name"] == "pdserve-gateway"
        assert span["service.name"] == f"pdserve-{worker_root.split('.')[0]}"
    for child in ("prefill.queue", "prefill.compute", "kv.transfer", "decode.kv_wait",
                  "decode.generate"):
        assert child in names, f"no {child} span"
    # every span lies inside its parent, give or take the clocks' reading order
    for s in spans:
        parent = ids.get(s["parent_span_id"])
        if parent is not None:
            assert parent["start_ns"] - 5e6 <= s["start_ns"] <= s["end_ns"] <= \
                parent["end_ns"] + 5e6, (s["name"], parent["name"])
    # the root covers what the client waited for, less the HTTP round trip
    root_s = (root["end_ns"] - root["start_ns"]) / 1e9
    assert 0.7 * latency - 0.05 <= root_s <= latency
    # the gateway's phases follow one another inside it and add up to it
    phases = [s for s in spans if s["parent_span_id"] == root["span_id"]]
    covered = sum(s["end_ns"] - s["start_ns"] for s in phases) / 1e9
    assert 0.8 * root_s <= covered <= root_s * 1.01 + 0.01
    gen = names["decode.generate"][0]
    assert gen["attributes"].get("gen_ai.usage.completion_tokens") == 12 or \
        gen["attributes"].get("pdserve.output_tokens") == 12

    timing = r.json()["nvext"]["timing"]
    assert timing["trace_id"] == CLIENT_TRACE
    assert 0 < timing["ttft_ms"] <= timing["total_time_ms"] <= latency * 1000
    assert abs(timing["total_time_ms"] / 1000 - root_s) <= 0.1 * root_s + 0.05
    roles = {w["role"]: w for w in timing["workers"]}
    assert set(roles) == {"prefill", "decode"}
    assert roles["decode"]["counts"]["output_tokens"] == 12
    assert roles["prefill"]["counts"]["prompt_tokens"] > 0
    ids_block = r.json()["nvext"]["worker_id"]
    assert ids_block["prefill_worker_id"] and ids_block["decode_worker_id"]


def test_streamed_request_carries_timing_in_its_last_chunk(traced):
    stack, _ = traced
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "stream": True,
            "nvext": {"extra_fields": ["timing"]}}
    with httpx.stream("POST", stack.procs[-1].http + "/v1/completions", json=body,
                      timeout=120) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    import json

    chunks = [json.loads(e) for e in events[:-1]]
    assert "nvext" in chunks[-1] and all("nvext" not in c for c in chunks[:-1])
    timing = chunks[-1]["nvext"]["timing"]
    assert {w["role"] for w in timing["workers"]} == {"prefill", "decode"}
    assert timing["ttft_ms"] <= timing["total_time_ms"]
