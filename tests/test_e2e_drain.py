"""Graceful drain (serving/drain.py): a decode worker SIGTERMed while 12 streams run on it, with
another decode worker registered. Given the time, it finishes them itself; with a short
--drain-timeout the gateway moves the streams still running to the other worker. Either way
every stream completes token-exact with the calm run, no client sees an error, the worker
exits 0, and nothing is left in any pool."""

from __future__ import annotations

import signal
import time
import threading

import openai
import pytest

from cluster import health
from tests.stack import metric, standard_stack, wait_idle
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
STREAMS = 12
MAX_TOKENS = 64
PROMPTS = [f"Write a short note number {i} about the sea, the sky and the wind:"
           for i in range(STREAMS)]


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    with standard_stack(model_dir, tmp_path_factory.mktemp("drain"), decodes=("decode-a",),
                        decode_args=("--drain-timeout", "60")) as s:
        yield s


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.proc("gateway").http + "/v1", api_key="none",
                         max_retries=0, timeout=120)


def run_streams(stack, started: threading.Event | None = None) -> list:
    """The PROMPTS as concurrent greedy streams; -> each one's (text, finish_reason) or the
    exception it raised. `started` is set once every stream has its first token."""
    results: list = [None] * STREAMS
    first = threading.Semaphore(0)

    def one(i: int) -> None:
        text, reason, seen = "", None, False
        try:
            for chunk in client(stack).completions.create(
                    model="SmolLM2-135M-Instruct", prompt=PROMPTS[i], max_tokens=MAX_TOKENS,
                    temperature=0, stream=True, extra_body={"ignore_eos": True}):
                c = chunk.choices[0]
                text += c.text
                reason = c.finish_reason or reason
                if c.text and not seen:
                    seen = True
                    first.release()
            results[i] = (text, reason)
        except Exception as exc:          # noqa: BLE001 - reported by the caller
            results[i] = exc
            if not seen:
                first.release()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    for _ in range(STREAMS):
        first.acquire(timeout=180)
    if started is not None:
        started.set()
    return threads, results


def decode_workers(stack) -> int:
    import httpx

    return httpx.get(stack.proc("gateway").http + "/health", timeout=5).json()["workers"][
        "decode"]


def drain_while_streaming(stack, victim: str, successor: str, successor_args: tuple,
                          long_drain: bool) -> list:
    """`successor` registered but held back (SIGSTOP: its registration expires) while the
    streams start on `victim`, then let go; once the gateway lists both, SIGTERM the victim.
    -> the streams' results once all ended."""
    procs = [(p.popen, p.log) for p in stack.procs if p.alive()]
    nxt = stack.start_worker("decode", *successor_args, name=successor)
    wait_until(lambda: decode_workers(stack) == 2, 180, f"{successor} registered", procs)
    nxt.popen.send_signal(signal.SIGSTOP)
    try:
        wait_until(lambda: decode_workers(stack) == 1, 30, f"{successor} out of the registry")
        threads, results = run_streams(stack)
    finally:
        nxt.popen.send_signal(signal.SIGCONT)
    wait_until(lambda: decode_workers(stack) == 2, 30, f"{successor} registered again", procs)
    v = stack.proc(victim)
    v.popen.send_signal(signal.SIGTERM)
    # not ready (the drain has begun), still alive (the probe a long drain must not trip)
    wait_until(lambda: not health.grpc_serving(v.address), 10, f"{victim} not ready")
    if long_drain:
        assert health.grpc_serving(v.address, service=health.LIVENESS_SERVICE)
    # the gateway stops sending it work at once: a new request is served by the successor
    reply = client(stack).completions.create(model="SmolLM2-135M-Instruct", prompt="Hello",
                                             max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason == "length"
    for t in threads:
        t.join(180)
    assert v.popen.wait(90) == 0, v.log.read_text()[-3000:]
    log = v.log.read_text()
    running = int(log.split("draining: out of the registry, new requests refused, the ")[1]
                  .split(" running")[0])
    assert running >= 1, "the streams ended before the drain began: nothing was drained"
    return results


def test_a_drained_decode_worker_finishes_or_hands_on_every_stream(stack):
    import httpx

    assert httpx.get(stack.proc("gateway").http + "/ready", timeout=5).status_code == 200
    threads, calm = run_streams(stack)
    for t in threads:
        t.join(180)
    assert all(isinstance(r, tuple) and r[1] == "length" for r in calm), calm
    gw = stack.proc("gateway").http

    # 1. time enough: decode-a finishes its streams itself, refusing new work meanwhile
    moved_before = metric(gw + "/metrics", "pdserve_stream_migrations_total")
    results = drain_while_streaming(stack, "decode-a", "decode-b", ("--drain-timeout", "1"),
                                    long_drain=True)
    assert results == calm
    assert metric(gw + "/metrics", "pdserve_stream_migrations_total") == moved_before
    assert "still running after the drain" not in stack.proc("decode-a").log.read_text()

    # 2. a drain shorter than the streams: decode-b ends them and the gateway moves them on
    results = drain_while_streaming(stack, "decode-b", "decode-c", (), long_drain=False)
    assert results == calm
    assert metric(gw + "/metrics", "pdserve_stream_migrations_total") > moved_before
    assert "still running after the drain" in stack.proc("decode-b").log.read_text()
    assert metric(gw + "/metrics", "pdserve_requests_failed_total") == 0
    wait_idle(stack.proc("prefill"), stack.proc("decode-c"))


def test_a_drained_gateway_finishes_its_streams_and_takes_no_new_request(stack):
    """Runs last: it stops the module's gateway."""
    import httpx

    threads, results = run_streams(stack)
    gw = stack.proc("gateway")
    gw.popen.send_signal(signal.SIGTERM)
    with pytest.raises(httpx.ConnectError):
        for _ in range(50):                  # the listening socket closes within moments
            httpx.get(gw.http + "/health", timeout=2)
            time.sleep(0.1)
    for t in threads:
        t.join(180)
    assert all(isinstance(r, tuple) and r[1] == "length" for r in results), results
    assert gw.popen.wait(60) == 0
    assert "gateway draining: 12 requests in flight" in gw.log.read_text()
