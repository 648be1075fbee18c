"""The gateway's failure paths with real processes: client gone (REST non-streaming, gRPC cancel),
a stop string, a prefill or decode worker dying mid-request (a clean error, never a hang), and a
clean SIGTERM. The tests run in file order on one stack and end by killing its workers."""

from __future__ import annotations

import json
import signal
import threading

import grpc
import httpx
import pytest
import redis

from cluster.registry import KEY_PREFIX
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from tests.stack import metric, standard_stack, wait_idle, wait_until

pytestmark = pytest.mark.slow

LONG = {"prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    with standard_stack(model_dir, tmp_path_factory.mktemp("stack")) as s:
        yield s


def _registered(stack) -> set[str]:
    client = redis.Redis.from_url(stack.redis_url)
    try:
        return {(client.hget(k, "address") or b"").decode()
                for k in client.scan_iter(KEY_PREFIX + "*")} - {""}
    finally:
        client.close()


def _wait_registered(stack, addresses: set[str], timeout_s: float = 120) -> None:
    """Until the registry holds exactly these workers (dead ones expire after their TTL) and
    the gateway has applied a poll since: it logged each one joining and knows as many
    workers as there are."""
    gateway = stack.proc("gateway")
    wait_until(lambda: _registered(stack) == addresses, timeout_s,
               lambda: f"the registry to hold {addresses}, not {_registered(stack)}")

    def applied() -> bool:
        log = gateway.log.read_text()
        counts = httpx.get(gateway.http + "/health", timeout=5).json()["workers"]
        return (all(f" at {a})" in log for a in addresses)
                and counts["prefill"] + counts["decode"] == len(addresses))
    wait_until(applied, 30, "the gateway to know exactly the registered workers",
               [(gateway.popen, gateway.log)])


def generated(*workers) -> float:
    """Tokens the workers' engines have sampled so far (their pdserve_generated_tokens)."""
    return sum(metric(p.metrics, "pdserve_generated_tokens_total") for p in workers)


def test_non_streaming_client_gone_aborts_on_workers(stack):
    workers = stack.proc("prefill"), stack.proc("decode")
    before = generated(*workers)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack.proc("gateway").http + "/v1/completions", json=LONG, timeout=3)
    wait_idle(*workers)
    # idle because the request was aborted, not because it ran to its max_tokens (a fast host
    # generates them all within wait_idle's wait)
    assert generated(*workers) - before < LONG["max_tokens"]


def test_grpc_cancel_aborts_on_workers(stack):
    workers = stack.proc("prefill"), stack.proc("decode")
    before = generated(*workers)
    with grpc.insecure_channel(stack.proc("gateway").address) as ch:
        stream = pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
            text=LONG["prompt"], params=pb.SamplingParams(max_tokens=2000, ignore_eos=True)))
        for i, _ in enumerate(stream):
            if i == 3:
                stream.cancel()
                break
    wait_idle(*workers)
    # the four responses read were generated; the rest of the 2000 tokens never were
    assert 4 <= generated(*workers) - before < 2000


def test_stop_string_streaming_matches_non_streaming(stack):
    url = stack.proc("gateway").http + "/v1/completions"
    req = {"prompt": "Count: 1, 2, 3,", "max_tokens": 100, "temperature": 0, "stop": [" 7"]}
    full = httpx.post(url, json=req, timeout=60).json()["choices"][0]
    with httpx.stream("POST", url, json=dict(req, stream=True), timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert " 7" not in full["text"] and full["finish_reason"] == "stop"
    assert chunks[-1]["finish_reason"] == "stop"
    wait_idle(stack.proc("prefill"), stack.proc("decode"))


def _stream_in_thread(url: str, body: dict) -> tuple[threading.Thread, list]:
    events: list = []

    def read():
        try:
            with httpx.stream("POST", url, json=body, timeout=60) as r:
                events.extend(line for line in r.iter_lines() if line)
        except httpx.HTTPError as exc:
            events.append(repr(exc))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, events


def test_prefill_death_is_a_clean_error_and_frees_decode(stack):
    url = stack.proc("gateway").http + "/v1/completions"
    stack.proc("prefill").kill()
    resp = httpx.post(url, json={"prompt": "hi", "max_tokens": 4}, timeout=60)
    assert resp.status_code == 503, resp.text
    assert "prefill worker" in resp.json()["error"]["message"]
    wait_idle(stack.proc("decode"))


def test_decode_death_mid_stream_ends_the_stream_with_an_error(stack):
    gateway = stack.proc("gateway")
    new = stack.start_worker("prefill", name="prefill2")
    _wait_registered(stack, {new.address, stack.proc("decode").address})
    thread, events = _stream_in_thread(gateway.http + "/v1/completions", dict(LONG, stream=True))
    wait_until(lambda: len(events) >= 3, 60, lambda: f"three events of the stream: {events}",
               interval_s=0.05)
    stack.proc("decode").kill()
    thread.join(30)
    assert not thread.is_alive(), "the stream hung after the decode worker died"
    assert events[-1] == "data: [DONE]"
    assert "decode worker" in json.loads(events[-2][6:])["error"]["message"]
    resp = httpx.post(gateway.http + "/v1/completions", json={"prompt": "hi", "max_tokens": 4},
                      timeout=30)
    assert resp.status_code == 503
    # not ready without a decode worker (its registration expires), though alive
    wait_until(lambda: httpx.get(gateway.http + "/ready", timeout=5).status_code == 503, 30,
               "the gateway not ready")
    assert httpx.get(gateway.http + "/ready", timeout=5).json()["status"] == (
        "no decode worker registered")
    assert httpx.get(gateway.http + "/health", timeout=5).status_code == 200


def test_sigterm_stops_the_gateway_cleanly(stack):
    gateway = stack.proc("gateway")
    gateway.popen.send_signal(signal.SIGTERM)
    assert gateway.popen.wait(20) == 0
