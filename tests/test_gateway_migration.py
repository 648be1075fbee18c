"""The pipeline against scripted in-process workers (real gRPC, fake engines): a decode stream
that breaks mid-way goes on on another decode worker from the tokens sent (resume_token_ids),
the client seeing each token once; a stalled stream does the same; when no move is possible (the
limit, n > 1, no other worker, a failing KV transfer on the move) the client gets an honest
error naming no worker id or address; a worker's RESOURCE_EXHAUSTED is a 429 (one more try on
another worker first); a worker that ends a choice with anything but stop/length is an error."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import grpc
import pytest

from gateway.errors import GatewayError
from gateway.params import GenerationParams, Prompt, RequestPreparer, ServedModel
from gateway.pipeline import Pipeline, PipelineConfig
from gateway.router import Route
from gateway.tokenizer import Tokenizer
from cluster.metrics import GatewayMetrics
from cluster.registry import WorkerInfo
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

TEXT = " one two three four five six seven eight nine ten"
LEAK = "ipv4:127.0.0.1:59999 (decode-127.0.0.1-59999)"     # what a worker's error may say


@dataclass
class Script:
    """What one decode worker does with each Decode call: stream `tokens[i]` batches (after
    the prefill has "sent" the KV), then end with `end`: "finish", "unavailable", "stall",
    "abort", "exhausted" (at once), "eof"."""

    batches: list[list[int]] = field(default_factory=list)
    end: str = "finish"
    calls: list[pb.DecodeRequest] = field(default_factory=list)


class FakeDecode(pb_grpc.DecodeWorkerServicer):
    def __init__(self, cluster: "Cluster", script: Script) -> None:
        self.cluster, self.script = cluster, script

    async def Decode(self, request, context):
        s = self.script
        s.calls.append(request)
        if s.end == "exhausted":
            context.set_trailing_metadata((("retry-after", "2"),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        yield pb.DecodeEvent(reservation=pb.KVDescriptor(transport="grpc", block_ids=[0]))
        await self.cluster.kv_ready(request.request_id).wait()
        last = len(s.batches) - 1
        for i, ids in enumerate(s.batches):
            reason = "length" if i == last and s.end == "finish" else ""
            reason = "abort" if i == last and s.end == "abort" else reason
            yield pb.DecodeEvent(tokens=pb.TokenBatch(token_ids=ids, finish_reason=reason))
            await asyncio.sleep(0.01)               # a worker's pace between token batches
        if s.end == "unavailable":
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"Socket closed by {LEAK}")
        if s.end == "stall":
            await asyncio.sleep(30)                 # silent on purpose: the stall under test


class FakePrefill(pb_grpc.PrefillWorkerServicer):
    def __init__(self, cluster: "Cluster") -> None:
        self.cluster = cluster
        self.calls: list[pb.PrefillRequest] = []
        self.fail_from = 1 << 30        # calls from this one on fail their KV transfer

    async def Prefill(self, request, context):
        self.calls.append(request)
        if len(self.calls) > self.fail_from:
            await context.abort(grpc.StatusCode.ABORTED, f"KV push to {LEAK} failed")
        self.cluster.kv_ready(request.request_id).set()
        return pb.PrefillReply(first_token_id=0)


class _Ticket:
    def release(self) -> None:
        pass


class Cluster:
    """Scripted workers on real gRPC servers, and the router surface the pipeline uses."""

    def __init__(self, scripts: list[Script]) -> None:
        self.scripts = scripts
        self._kv: dict[str, asyncio.Event] = {}
        self._servers: list[grpc.aio.Server] = []
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.prefill = FakePrefill(self)
        self._workers: list[WorkerInfo] = []
        self.routes: list[tuple[int, ...]] = []

    def kv_ready(self, rid: str) -> asyncio.Event:
        return self._kv.setdefault(rid, asyncio.Event())

    async def start(self) -> None:
        servicers = [("prefill", self.prefill)] + [("decode", FakeDecode(self, s))
                                                   for s in self.scripts]
        for i, (role, servicer) in enumerate(servicers):
            server = grpc.aio.server()
            if role == "prefill":
                pb_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
            else:
                pb_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            self._servers.append(server)
            self._workers.append(WorkerInfo(f"{role}-127.0.0.1-{port}", role, f"127.0.0.1:{port}",
                                            "m", 16, 0, "float32", 1, 1, 8, 64))

    async def stop(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        for server in self._servers:
            await server.stop(0)

    # ---- the router's surface
    def workers(self, role: str) -> list[WorkerInfo]:
        return [w for w in self._workers if w.role == role]

    async def route(self, tokens, cache_salt="", avoid=frozenset(), lora="") -> Route:
        self.routes.append(tuple(tokens))

        def pick(role):
            ws = self.workers(role)
            return next((w for w in ws if w.id not in avoid), ws[0])
        return Route(pick("prefill"), pick("decode"), "load", 0)

    def enqueue_prefill(self, worker, tokens) -> _Ticket:
        return _Ticket()

    def queued_prompts(self, worker_id: str) -> int:
        return 0

    @contextlib.contextmanager
    def track(self, *workers):
        yield

    def channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address)
        return self._channels[address]

    def mark_unreachable(self, worker, avoid_s: float = 5.0) -> None:
        pass


@pytest.fixture(scope="module")
def preparer(model_dir):
    return RequestPreparer(Tokenizer(model_dir), ServedModel("smol", 2048))


def run(preparer, scripts: list[Script], n: int = 1, prefill_fail_from: int | None = None,
        **config):
    """(deltas, error or None, cluster, metrics) of one request through the scripted workers."""
    ids = preparer.tokenizer.encode(TEXT, add_special_tokens=False)
    params = GenerationParams.from_client(max_tokens=len(ids), n=n, ignore_eos=True)
    prepared = preparer.prepare(Prompt(text="Count:"), params)

    async def go():
        cluster = Cluster(scripts)
        if prefill_fail_from is not None:
            cluster.prefill.fail_from = prefill_fail_from
        await cluster.start()
        metrics = GatewayMetrics()
        pipeline = Pipeline(cluster, preparer.tokenizer, PipelineConfig(**config), metrics)
        deltas, error = [], None
        try:
            async with contextlib.aclosing(pipeline.generate(prepared)) as stream:
                async for d in stream:
                    deltas.append(d)
        except GatewayError as exc:
            error = exc
        finally:
            await cluster.stop()
        return deltas, error, cluster, metrics

    return ids, prepared, asyncio.run(go())


def _tokens(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def _no_leak(err: GatewayError) -> None:
    assert "127.0.0.1" not in err.message and "59999" not in err.message, err.message
    assert "decode-" not in err.message and "prefill-" not in err.message, err.message


def test_a_broken_stream_goes_on_on_another_decode_worker(preparer):
    ids = preparer.tokenizer.encode(TEXT, add_special_tokens=False)
    a = Script([ids[:1], ids[1:3], ids[3:4]], "unavailable")
    b = Script([ids[4:6], ids[6:]], "finish")
    ids, prepared, (deltas, error, cluster, metrics) = run(preparer, [a, b])
    assert error is None
    assert _tokens(deltas) == ids                       # each token once, in order
    assert "".join(d.text for d in deltas) == TEXT
    assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == len(ids)
    resumed = b.calls[0]
    assert list(resumed.resume_token_ids) == ids[:4]
    assert list(resumed.prompt_token_ids) == list(prepared.prompt_token_ids)
    assert list(cluster.prefill.calls[1].resume_token_ids) == ids[:4]
    assert cluster.routes[1] == tuple(prepared.prompt_token_ids) + tuple(ids[:4])
    assert metrics.migrations._value.get() == 1 and metrics.retries._value.get() == 0


def test_a_stalled_stream_moves_too(preparer):
    ids = preparer.tokenizer.encode(TEXT, add_special_tokens=False)
    a = Script([ids[:2]], "stall")
    b = Script([ids[2:]], "finish")
    ids, _, (deltas, error, _, metrics) = run(preparer, [a, b], stream_stall_timeout_s=0.3)
    assert error is None and _tokens(deltas) == ids
    assert list(b.calls[0].resume_token_ids) == ids[:2]
    assert metrics.stalls._value.get() == 1 and metrics.migrations._value.get() == 1


@pytest.mark.parametrize("case", ["limit", "no-other-worker", "n>1", "transfer-fails", "stall"])
def test_a_stream_that_cannot_move_ends_in_an_honest_error(preparer, case):
    ids = preparer.tokenizer.encode(TEXT, add_special_tokens=False)
    end = "stall" if case == "stall" else "unavailable"
    a = Script([ids[:1], ids[1:3]], end)
    b = Script([ids[3:]], "finish")
    kw: dict = {"stream_stall_timeout_s": 0.3} if case == "stall" else {}
    scripts, n = [a, b], 1
    if case in ("limit", "stall"):
        kw["max_migrations"] = 0
    if case == "no-other-worker":
        scripts = [a]
    if case == "n>1":
        n = 2
    if case == "transfer-fails":           # the move's KV transfer fails: no move left after it
        kw["max_migrations"] = 1
    ids, _, (deltas, error, cluster, metrics) = run(
        preparer, scripts, n=n, prefill_fail_from=1 if case == "transfer-fails" else None, **kw)
    assert error is not None and error.status >= 500, case
    assert not any(d.finish_reason for d in deltas), "a failed request must not look finished"
    assert _tokens(deltas) == ids[:3] if n == 1 else _tokens(deltas)
    _no_leak(error)
    want = {"stall": "stalled", "transfer-fails": "prefill worker failed: ABORTED"}
    assert want.get(case, "decode worker failed: UNAVAILABLE") in error.message, error.message
    assert metrics.migrations._value.get() == (1 if case == "transfer-fails" else 0)
    if case != "transfer-fails":
        assert not b.calls


def test_overloaded_workers_are_429_after_one_try_elsewhere(preparer):
    ids = preparer.tokenizer.encode(TEXT, add_special_tokens=False)
    full, ok = Script(end="exhausted"), Script([ids], "finish")
    _, _, (deltas, error, _, metrics) = run(preparer, [full, ok])
    assert error is None and _tokens(deltas) == ids and len(full.calls) == 1
    assert metrics.retries._value.get() == 1
    full = Script(end="exhausted")
    _, _, (deltas, error, _, _) = run(preparer, [full])
    assert error.status == 429 and error.retry_after == 2.0 and error.code == "overloaded"
    assert error.headers() == {"Retry-After": "2"} and len(full.calls) == 1
    _no_leak(error)


def test_a_worker_ending_a_choice_otherwise_than_stop_or_length_is_an_error(preparer):
    ids = preparer.tokenizer.encode(TEXT, add_special_tokens=False)
    _, _, (deltas, error, _, _) = run(preparer, [Script([ids[:2], ids[2:3]], "abort")])
    assert error is not None and error.status == 500 and "'abort'" in error.message
    assert not any(d.finish_reason for d in deltas)
