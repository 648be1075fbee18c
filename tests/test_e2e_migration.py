"""A stream survives its decode worker, with real processes: one prefill and two decode workers
and a gateway (--max-migrations 1). The decode worker serving a stream is killed (-9) or stopped
(SIGSTOP, past --stream-stall-timeout) mid-stream: the client sees one uninterrupted stream
whose tokens equal HF's greedy ones, and a seeded sampled request with penalties gives the
tokens of the same request run without a fault. The migration metric counts every move; once a
request has used its move, the next failure ends its stream with an OpenAI error event (no
finish, no worker address), then [DONE]."""

from __future__ import annotations

import json
import os
import signal
import threading

import grpc
import httpx
import pytest

from cluster import health
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from tests.stack import metric, standard_stack, wait_until
from tests.test_e2e import hf, hf_greedy  # noqa: F401  (module fixture)
from tests.test_gateway_failures import _wait_registered

pytestmark = pytest.mark.slow

NEW = 40
STALL_S = 6
PROMPT = "Once upon a time, in a small village at the edge of a great forest,"
SAMPLED = dict(temperature=0.8, top_p=0.95, top_k=40, seed=1234, frequency_penalty=0.4,
               repetition_penalty=1.1, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    # the probe off: a stopped worker here stands for one whose stream stalls while it still
    # answers (a wedged engine thread), which only the stall timeout catches (a stopped one is
    # found hung first at the defaults: tests/test_e2e_hang.py)
    gateway = ("--max-migrations", "1", "--stream-stall-timeout", str(STALL_S),
               "--worker-probe-timeout", "0")
    with standard_stack(model_dir, tmp_path_factory.mktemp("migration"), gateway_args=gateway,
                        decodes=("decode-a", "decode-b")) as s:
        yield s


def decodes(stack) -> list:
    return [p for p in stack.procs if p.name.startswith("decode") and p.alive()]


def serving(stack, exclude: tuple[str, ...] = ()):
    """The live decode worker running a request (not among `exclude`)."""
    found: list = []

    def find():
        found[:] = [p for p in decodes(stack) if p.name not in exclude
                    and metric(p.metrics, "pdserve_requests_running") > 0]
        return bool(found)
    wait_until(find, 30, "a decode worker running the request")
    return found[0]


def migrations(stack) -> float:
    return metric(stack.proc("gateway").http + "/metrics", "pdserve_stream_migrations_total")


class GrpcStream:
    """A Generate call read on a thread: token ids, finish reason, error."""

    def __init__(self, stack, ids: list[int], **params) -> None:
        self.tokens: list[int] = []
        self.reason, self.error = "", None
        self._channel = grpc.insecure_channel(stack.proc("gateway").address)
        stub = pb_grpc.GenerationStub(self._channel)
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                                     params=pb.SamplingParams(**params))
        self._thread = threading.Thread(target=self._read, args=(stub, request), daemon=True)
        self._thread.start()

    def _read(self, stub, request) -> None:
        try:
            for r in stub.Generate(request, timeout=240):
                self.tokens += r.token_ids
                self.reason = r.finish_reason or self.reason
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self._channel.close()

    def wait_tokens(self, n: int) -> None:
        wait_until(lambda: len(self.tokens) >= n or not self._thread.is_alive(), 120,
                   f"{n} tokens")
        assert len(self.tokens) >= n, (self.tokens, self.reason, self.error)

    def join(self) -> None:
        self._thread.join(240)
        assert not self._thread.is_alive(), "the stream hung"


def replace_decode(stack, victim, name: str) -> None:
    """Start a decode worker for the killed `victim`; wait until the registry lists exactly
    the live workers."""
    assert not victim.alive()
    new = stack.start_worker("decode", name=name)
    wait_until(lambda: health.grpc_serving(new.address, 1.0), 180, name, [(new.popen, new.log)])
    live = {p.address for p in stack.procs
            if p.alive() and p.name not in ("redis", "gateway")}
    _wait_registered(stack, live)


@pytest.fixture(scope="module")
def prompt(hf):  # noqa: F811
    return hf[0](PROMPT).input_ids


def test_a_greedy_stream_survives_its_decode_worker(stack, hf, prompt):  # noqa: F811
    ref = hf_greedy(hf, prompt, NEW)
    assert len(ref) == NEW, "the reference must not end early"
    before = migrations(stack)
    s = GrpcStream(stack, prompt, temperature=0.0, max_tokens=NEW)
    s.wait_tokens(4)
    victim = serving(stack)
    victim.kill()
    s.join()
    assert s.error is None, s.error
    assert s.tokens == ref, (hf[0].decode(s.tokens), hf[0].decode(ref))
    assert s.reason == "length"
    assert migrations(stack) == before + 1
    replace_decode(stack, victim, "decode-c")


def test_a_seeded_sampled_stream_survives_its_decode_worker(stack, prompt):
    plain = GrpcStream(stack, prompt, **SAMPLED)
    plain.join()
    assert plain.error is None and len(plain.tokens) == NEW
    before = migrations(stack)
    s = GrpcStream(stack, prompt, **SAMPLED)
    s.wait_tokens(4)
    victim = serving(stack)
    victim.kill()
    s.join()
    assert s.error is None, s.error
    assert s.tokens == plain.tokens
    assert migrations(stack) == before + 1
    replace_decode(stack, victim, "decode-d")


def test_a_stalled_stream_moves_and_the_stalled_worker_lets_go(stack, hf, prompt):  # noqa: F811
    ref = hf_greedy(hf, prompt, NEW)
    url = stack.proc("gateway").http + "/metrics"
    before, stalls = migrations(stack), metric(url, "pdserve_stream_stalls_total")
    s = GrpcStream(stack, prompt, temperature=0.0, max_tokens=NEW)
    s.wait_tokens(4)
    stalled = serving(stack)
    os.kill(stalled.popen.pid, signal.SIGSTOP)
    try:
        s.join()
    finally:
        os.kill(stalled.popen.pid, signal.SIGCONT)
    assert s.error is None, s.error
    assert s.tokens == ref
    assert migrations(stack) == before + 1
    assert metric(url, "pdserve_stream_stalls_total") == stalls + 1
    wait_until(lambda: metric(stalled.metrics, "pdserve_kv_blocks_free")
               == metric(stalled.metrics, "pdserve_kv_blocks_total"), 30,
               "the stalled worker's pool all free")
    live = {p.address for p in stack.procs if p.alive() and p.name not in ("redis", "gateway")}
    _wait_registered(stack, live)


def test_past_the_migration_limit_ends_the_stream_in_an_error(stack, hf, prompt):  # noqa: F811
    """REST streaming: the first failure moves the stream, the second ends it."""
    ref_text = hf[0].decode(hf_greedy(hf, prompt, NEW), skip_special_tokens=True)
    before = migrations(stack)
    events: list[str] = []

    def read():
        with httpx.stream("POST", stack.proc("gateway").http + "/v1/completions", timeout=240,
                          json={"prompt": prompt, "max_tokens": NEW, "temperature": 0,
                                "stream": True}) as r:
            events.extend(line[6:] for line in r.iter_lines() if line.startswith("data: "))
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    wait_until(lambda: len(events) >= 4, 120, "4 events")
    first = serving(stack)
    first.kill()
    second = serving(stack, exclude=(first.name,))       # the stream moved there
    seen = len(events)
    wait_until(lambda: len(events) >= seen + 2, 60, "tokens after the move")
    second.kill()
    thread.join(120)
    assert not thread.is_alive(), "the stream hung"
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "decode worker" in error["message"]
    assert "127.0.0.1" not in error["message"] and "decode-" not in error["message"], error
    chunks = [json.loads(e)["choices"][0] for e in events[:-2]]
    assert not any(c["finish_reason"] for c in chunks), "a failed stream must not finish"
    text = "".join(c["text"] for c in chunks)
    assert len(text) > 0 and ref_text.startswith(text), (text, ref_text)
    assert migrations(stack) == before + 1
    wait_until(lambda: metric(stack.proc("prefill").metrics, "pdserve_kv_blocks_free")
               == metric(stack.proc("prefill").metrics, "pdserve_kv_blocks_total"), 20,
               "the prefill pool all free")
