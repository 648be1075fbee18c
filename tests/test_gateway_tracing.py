"""The gateway's side of tracing and the timing block, against in-process workers on real gRPC
servers (scripted engines): a client's W3C traceparent (HTTP header or gRPC metadata) becomes
the parent of the request's root span; the gateway's spans nest (root > phases and attempts >
the worker calls); each worker call carries a traceparent whose parent is the gateway's client
span of that call; nvext asks for the timing block and the worker ids (anything else is a 400
naming it); gRPC's return_timing puts a RequestTiming on the final response; and with tracing
off the gateway calls no tracer at all."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest
import redis.asyncio as aioredis
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from cluster.auth import METADATA_KEY, ClusterAuth
from cluster.prefix_directory import blocks_key
from cluster.registry import WorkerInfo
from cluster.tracing import Tracing, TracingSettings
from gateway.grpc_api import add_services
from gateway.openai_api import create_app
from gateway.params import RequestPreparer, ServedModel
from gateway.pipeline import Pipeline
from gateway.router import Router
from gateway.tokenizer import Tokenizer
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from engine.block_hash import BlockHasher
from tests.test_gateway_migration import Cluster, Script
from tests.test_gateway_router import register, worker

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
PHASES = {"validate", "tokenize", "admission_wait", "route", "reservation", "prefill", "ttft",
          "total"}


def _timing(worker_id: str, role: str, **counts) -> pb.WorkerTiming:
    return pb.WorkerTiming(worker_id=worker_id, role=role, seconds={"total": 0.25},
                           counts=counts)


class Decode(pb_grpc.DecodeWorkerServicer):
    """A scripted decode worker that keeps each call's metadata and, asked, reports timing."""

    def __init__(self, cluster: "Workers", script: Script, wid: str) -> None:
        self.cluster, self.script, self.wid = cluster, script, wid
        self.metadata: list[dict] = []

    async def Decode(self, request, context):
        self.script.calls.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        if self.script.end == "exhausted":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        yield pb.DecodeEvent(reservation=pb.KVDescriptor(transport="grpc", block_ids=[0]))
        await self.cluster.kv_ready(request.request_id).wait()
        for i, ids in enumerate(self.script.batches):
            last = i == len(self.script.batches) - 1
            tb = pb.TokenBatch(token_ids=ids, finish_reason="length" if last else "")
            if last and request.return_timing:
                tb.timing.CopyFrom(_timing(self.wid, "decode", output_tokens=7))
            yield pb.DecodeEvent(tokens=tb)


class Prefill(pb_grpc.PrefillWorkerServicer):
    def __init__(self, cluster: "Workers") -> None:
        self.cluster = cluster
        self.calls: list[pb.PrefillRequest] = []
        self.metadata: list[dict] = []
        self.wid = ""

    async def Prefill(self, request, context):
        self.calls.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        self.cluster.kv_ready(request.request_id).set()
        reply = pb.PrefillReply(first_token_id=0, num_prompt_tokens=3)
        if request.return_timing:
            reply.timing.CopyFrom(_timing(self.wid, "prefill", prompt_tokens=3))
        return reply


class Workers(Cluster):
    """Cluster's router surface over the recording workers above; with a deployment token
    (`auth`) the servers check it and the channels add it, as a deployment's do."""

    def __init__(self, scripts: list[Script], auth: ClusterAuth = ClusterAuth()) -> None:
        super().__init__(scripts)
        self.auth = auth

    def channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = self.auth.channel(address)
        return self._channels[address]

    async def start(self) -> None:
        self.prefill = Prefill(self)
        self.decodes: list[Decode] = []
        for role, script in [("prefill", None)] + [("decode", s) for s in self.scripts]:
            server = grpc.aio.server(interceptors=self.auth.server_interceptors())
            port = server.add_insecure_port("127.0.0.1:0")
            wid = f"{role}-127.0.0.1-{port}"
            if role == "prefill":
                self.prefill.wid = wid
                pb_grpc.add_PrefillWorkerServicer_to_server(self.prefill, server)
            else:
                self.decodes.append(Decode(self, script, wid))
                pb_grpc.add_DecodeWorkerServicer_to_server(self.decodes[-1], server)
            await server.start()
            self._servers.append(server)
            self._workers.append(WorkerInfo(wid, role, f"127.0.0.1:{port}", "m", 16, 0,
                                            "float32", 1, 1, 8, 64))


@pytest.fixture(scope="module")
def preparer(model_dir):
    return RequestPreparer(Tokenizer(model_dir), ServedModel("smol", 2048))


def _tracing() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return Tracing(TracingSettings(service_name="pdserve-gateway"), exporter=exporter), exporter


def _ids(preparer) -> list[int]:
    return preparer.tokenizer.encode(" one two three four", add_special_tokens=False)


def rest(preparer, tracing: Tracing, requests: list[tuple[dict, dict]],
         scripts: list[Script], auth: ClusterAuth = ClusterAuth()):
    """POST each (body, headers) to /v1/completions through the gateway's app and the scripted
    workers; (responses, workers)."""
    async def go():
        workers = Workers(scripts, auth)
        await workers.start()
        app = create_app(preparer, Pipeline(workers, preparer.tokenizer, tracing=tracing),
                         workers)
        out = []
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://gateway") as client:
                for body, headers in requests:
                    r = await client.post("/v1/completions", json=body, headers=headers)
                    out.append((r.status_code, r.text))
        finally:
            await workers.stop()
        return out, workers
    return asyncio.run(go())


def _body(ids, **kw) -> dict:
    return {"prompt": "Count:", "max_tokens": len(ids), "ignore_eos": True, **kw}


def _by_name(spans) -> dict[str, list]:
    out: dict[str, list] = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def _traceparent_parent(metadata: dict) -> tuple[str, str]:
    """(trace id, parent span id) of the traceparent a worker got."""
    _, trace_id, span_id, _ = metadata["traceparent"].split("-")
    return trace_id, span_id


@pytest.mark.parametrize("token", [None, "deployment-secret"], ids=["open", "token"])
def test_a_client_traceparent_parents_the_trace_and_worker_calls_carry_their_spans(preparer,
                                                                                    token):
    tracing, exporter = _tracing()
    ids = _ids(preparer)
    (resp,), workers = rest(preparer, tracing, [(_body(ids), {"traceparent": TRACEPARENT})],
                            [Script([ids[:2], ids[2:]])], ClusterAuth(token))
    assert resp[0] == 200, resp
    spans = _by_name(exporter.get_finished_spans())
    (root,) = spans["pdserve.request"]
    assert root.kind == SpanKind.SERVER
    assert format(root.context.trace_id, "032x") == TRACE_ID
    assert format(root.parent.span_id, "016x") == PARENT_ID
    assert root.attributes["gen_ai.request.model"] == "smol"
    assert root.attributes["gen_ai.usage.completion_tokens"] == len(ids)
    assert list(root.attributes["gen_ai.response.finish_reasons"]) == ["length"]
    assert root.attributes["gen_ai.latency.e2e"] >= root.attributes[
        "gen_ai.latency.time_to_first_token"] > 0
    for name in ("gateway.validate", "gateway.tokenize", "gateway.admission_wait",
                 "gateway.route", "gateway.attempt"):
        (span,) = spans[name]
        assert span.parent.span_id == root.context.span_id, name
        assert span.context.trace_id == root.context.trace_id, name
    route = spans["gateway.route"][0].attributes
    assert route["pdserve.route.reason"] == "load"
    assert route["pdserve.route.decode_worker"] == workers.decodes[0].wid
    attempt = spans["gateway.attempt"][0]
    for name, worker in (("gateway.decode", workers.decodes[0]),
                         ("gateway.prefill", workers.prefill)):
        (span,) = spans[name]
        assert span.kind == SpanKind.CLIENT and span.parent.span_id == attempt.context.span_id
        (metadata,) = worker.metadata
        assert _traceparent_parent(metadata) == (TRACE_ID, format(span.context.span_id, "016x"))
        assert metadata.get(METADATA_KEY) == token      # the channel's own metadata still goes
    assert [e.name for e in spans["gateway.decode"][0].events] == ["reservation"]


def test_without_a_traceparent_a_trace_starts_and_retries_are_attempts(preparer):
    tracing, exporter = _tracing()
    ids = _ids(preparer)
    (resp,), workers = rest(preparer, tracing, [(_body(ids), {})],
                            [Script(end="exhausted"), Script([ids])])
    assert resp[0] == 200, resp
    spans = _by_name(exporter.get_finished_spans())
    (root,) = spans["pdserve.request"]
    assert root.parent is None and root.attributes["pdserve.attempts"] == 2
    attempts = spans["gateway.attempt"]
    assert sorted(a.attributes["pdserve.attempt"] for a in attempts) == [1, 2]
    assert {a.attributes["pdserve.worker.decode"] for a in attempts} == {
        d.wid for d in workers.decodes}
    failed = next(a for a in attempts if a.attributes["pdserve.attempt"] == 1)
    assert not failed.status.is_ok and len(spans["gateway.decode"]) == 2


@pytest.mark.parametrize("nvext,message", [
    ({"extra_fields": ["timing", "latency"]}, "'latency'"),
    ({"extra_fields": ["timing"], "annotations": ["x"]}, "nvext.annotations"),
    ({"extra_fields": "timing"}, "nvext.extra_fields")])
def test_nvext_asks_only_for_what_exists(preparer, nvext, message):
    ids = _ids(preparer)
    (resp,), workers = rest(preparer, Tracing.off(), [(_body(ids, nvext=nvext), {})],
                            [Script([ids])])
    assert resp[0] == 400, resp
    err = json.loads(resp[1])["error"]
    assert err["param"].startswith("nvext.") and message in err["message"], err
    assert not workers.scripts[0].calls


def _check_timing(nvext: dict, workers: Workers, attempts: int = 1) -> None:
    assert set(nvext) == {"timing", "worker_id"}
    assert nvext["worker_id"] == {"prefill_worker_id": workers.prefill.wid,
                                  "decode_worker_id": workers.decodes[-1].wid}
    timing = nvext["timing"]
    assert PHASES <= set(timing["phases_ms"]), timing
    assert 0 < timing["ttft_ms"] <= timing["total_time_ms"] == timing["phases_ms"]["total"]
    assert timing["request_received_ms"] > 1.7e12 and timing["attempts"] == attempts
    assert [(w["role"], w["worker_id"]) for w in timing["workers"]] == [
        ("prefill", workers.prefill.wid), ("decode", workers.decodes[-1].wid)]
    assert timing["workers"][0] == {"worker_id": workers.prefill.wid, "role": "prefill",
                                    "phases_ms": {"total": 250.0},
                                    "counts": {"prompt_tokens": 3}}


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: {")]


def test_the_timing_block_in_full_and_streamed_responses(preparer):
    tracing, exporter = _tracing()
    ids = _ids(preparer)
    ask = {"extra_fields": ["timing", "worker_id"]}
    requests = [(_body(ids, nvext=ask), {}), (_body(ids, nvext=ask, stream=True), {}),
                (_body(ids, nvext=ask, stream=True, stream_options={"include_usage": True}),
                 {}), (_body(ids), {})]
    responses, workers = rest(preparer, tracing, requests,
                              [Script([ids[:1], ids[1:]])])      # serves all four
    assert all(status == 200 for status, _ in responses), responses
    full = json.loads(responses[0][1])
    _check_timing(full["nvext"], workers)
    roots = _by_name(exporter.get_finished_spans())["pdserve.request"]
    assert full["nvext"]["timing"]["trace_id"] in {format(r.context.trace_id, "032x")
                                                   for r in roots}
    for status, text in responses[1:3]:
        events = _events(text)
        assert [("nvext" in e) for e in events] == [False] * (len(events) - 1) + [True]
        _check_timing(events[-1]["nvext"], workers)
    assert _events(responses[2][1])[-1]["choices"] == []      # the usage chunk is last
    assert "nvext" not in json.loads(responses[3][1])
    asked = [c.return_timing for c in workers.scripts[0].calls]
    assert asked == [True, True, True, False]
    assert [c.return_timing for c in workers.prefill.calls] == asked


def test_grpc_return_timing_and_trace_context_from_metadata(preparer):
    tracing, exporter = _tracing()
    ids = _ids(preparer)

    async def go():
        workers = Workers([Script([ids[:2], ids[2:]]), Script([ids])])
        await workers.start()
        server = grpc.aio.server()
        await add_services(server, preparer, Pipeline(workers, preparer.tokenizer,
                                                      tracing=tracing))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GenerationStub(channel)
                out = []
                for timing in (True, False):
                    req = pb.GenerateRequest(text="Count:", return_timing=timing, params=(
                        pb.SamplingParams(max_tokens=len(ids), ignore_eos=True)))
                    out.append([r async for r in stub.Generate(
                        req, metadata=(("traceparent", TRACEPARENT),))])
        finally:
            await server.stop(None)
            await workers.stop()
        return out, workers

    (timed, plain), workers = asyncio.run(go())
    assert [r.HasField("timing") for r in timed] == [False] * (len(timed) - 1) + [True]
    t = timed[-1].timing
    assert PHASES <= set(t.seconds) and t.attempts == 1 and t.trace_id == TRACE_ID
    assert 0 < t.seconds["ttft"] <= t.seconds["total"] and t.received_unix_s > 1.7e9
    assert [(w.role, w.counts.get("prompt_tokens", 0)) for w in t.workers] == [
        ("prefill", 3), ("decode", 0)]
    assert not any(r.HasField("timing") for r in plain)
    roots = _by_name(exporter.get_finished_spans())["pdserve.request"]
    assert len(roots) == 2 and all(format(r.parent.span_id, "016x") == PARENT_ID
                                   for r in roots)
    assert all(r.attributes["gen_ai.usage.completion_tokens"] == len(ids) for r in roots)


def test_tracing_off_calls_no_tracer_and_sends_no_trace_context(preparer, monkeypatch):
    calls: list[str] = []
    for name in ("start", "extract", "record"):
        original = getattr(Tracing, name)

        def counted(self, *args, _name=name, _original=original, **kw):
            calls.append(_name)
            return _original(self, *args, **kw)
        monkeypatch.setattr(Tracing, name, counted)
    ids = _ids(preparer)
    ask = {"extra_fields": ["timing"]}
    responses, workers = rest(preparer, Tracing.off(), [
        (_body(ids), {"traceparent": TRACEPARENT}),
        (_body(ids, nvext=ask, stream=True), {"traceparent": TRACEPARENT})],
        [Script([ids]), Script([ids])])
    assert all(status == 200 for status, _ in responses), responses
    assert calls == []
    timing = _events(responses[1][1])[-1]["nvext"]["timing"]
    assert "trace_id" not in timing and timing["attempts"] == 1     # timing needs no tracing
    for metadata in workers.decodes[0].metadata + workers.prefill.metadata:
        assert "traceparent" not in metadata
    tracing, _ = _tracing()       # the same counters see a tracing gateway's calls
    rest(preparer, tracing, [(_body(ids), {})], [Script([ids])])
    assert "start" in calls



def test_a_route_names_the_prefill_candidates_it_weighed(redis_url):
    prompt = list(range(100, 164))                              # 4 blocks of 16

    async def body(router: Router):
        await register(redis_url, worker("d1", "decode", 1.0), worker("p1", "prefill", 2.0),
                       worker("p2", "prefill", 3.0))
        await router.start()
        client = aioredis.from_url(redis_url)
        await client.sadd(blocks_key("p2"), *BlockHasher(16, 0).hashes(prompt)[:3])
        await client.aclose()
        p1 = next(w for w in router.workers("prefill") if w.id == "p1")
        ticket = router.enqueue_prefill(p1, 30)
        try:
            return await router.route(prompt)
        finally:
            ticket.release()
            await router.stop()

    route = asyncio.run(body(Router(redis_url, poll_s=0.05)))
    assert route.prefill.id == "p2" and route.reason == "cached_prefix"
    assert sorted(route.candidates) == [("p1", 0, 30), ("p2", 48, 0)]
