"""Limits and admission: a worker's queue bound (RESOURCE_EXHAUSTED at once, 429 at the
gateway), the gateway's bound on requests in flight (429 + Retry-After), a request's share of a
worker's KV pool, token ids outside the vocabulary, a huge prompt tokenized off the event loop,
and an engine thread that dies (every request fails at once, later ones are refused, the worker
is told).

Units on a tiny random-weight model; the rest through real worker and gateway processes.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time

import grpc
import httpx
import pytest

from engine.async_engine import AsyncEngine, EngineDead, Overloaded
from engine.request import Request, SamplingParams
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from tests.conftest import make_engine
from tests.stack import standard_stack, wait_idle, wait_until, worker_stats
from tests.waiting import wait_until_async


# what these tests need beyond the small engine: steps of 32 tokens, 4 sequences at once
engine = functools.partial(make_engine, max_num_batched_tokens=32, max_num_seqs=4)


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


# ---------------------------------------------------------------- engine checks
def test_token_ids_outside_the_vocabulary_are_refused(tiny_model_dir):
    eng = engine(tiny_model_dir)
    vocab = eng.model_cfg.vocab_size
    for req in (Request("a", [1, vocab], GREEDY),
                Request("b", [1, 2], SamplingParams(max_tokens=4, stop_token_ids=(vocab + 5,))),
                Request("c", [1, 2], SamplingParams(max_tokens=4, logit_bias=((vocab, 1.0),)))):
        with pytest.raises(ValueError, match="out of the vocabulary"):
            eng.add_request(req)
    assert not eng.has_work() and eng.pool.num_free == eng.pool.num_blocks


def test_one_request_may_take_only_its_share_of_the_pool(tiny_model_dir):
    eng = engine(tiny_model_dir, num_blocks=32, max_request_kv_share=0.25)  # 8 blocks of 4
    eng.add_request(Request("fits", [1] * 10, SamplingParams(max_tokens=20)))   # 30 tokens: 8
    with pytest.raises(ValueError, match="max-request-kv-share"):
        eng.add_request(Request("long", [1] * 10, SamplingParams(max_tokens=40)))
    with pytest.raises(ValueError, match="max-request-kv-share"):    # choices count each
        eng.add_request(Request("wide", [1] * 10, SamplingParams(max_tokens=8, n=4)))


# ---------------------------------------------------------------- AsyncEngine
def test_a_full_queue_refuses_at_once(tiny_model_dir):
    async def run():
        aengine = AsyncEngine(engine(tiny_model_dir, max_num_seqs=1, num_blocks=256),
                              max_waiting=1)
        aengine.start()
        try:
            long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            q1 = await aengine.add(Request("r1", [1, 2, 3], long))
            await q1.get()                                   # r1 runs
            await aengine.add(Request("r2", [1, 2, 3], long))  # r2 waits
            t0 = time.perf_counter()
            with pytest.raises(Overloaded, match="max-waiting-requests 1"):
                await aengine.add(Request("r3", [1, 2, 3], long))
            refused_in = time.perf_counter() - t0
            for rid in ("r1", "r2"):
                await aengine.abort(rid)
            await aengine.add(Request("r4", [1, 2, 3], GREEDY))  # room again
            return refused_in
        finally:
            aengine.stop()

    assert asyncio.run(run()) < 1.0


def test_a_dead_engine_thread_fails_every_request_and_refuses_new_ones(tiny_model_dir):
    async def run():
        died = asyncio.Event()
        reasons = []
        aengine = AsyncEngine(engine(tiny_model_dir, num_blocks=256),
                              on_death=lambda r: (reasons.append(r), died.set()))
        aengine.start()
        long = SamplingParams(temperature=0.0, max_tokens=250, ignore_eos=True)
        running = await aengine.add(Request("running", [1, 2, 3], long))
        await running.get()

        def broken():
            raise RuntimeError("device lost")
        aengine.engine.has_work = broken            # the engine thread's own loop breaks
        await asyncio.wait_for(died.wait(), 10)
        errors = []
        while True:
            out = await asyncio.wait_for(running.get(), 10)
            if out.error:
                errors.append(out.error)
                break
        with pytest.raises(EngineDead, match="device lost"):
            await aengine.add(Request("late", [1, 2, 3], GREEDY))
        with pytest.raises(EngineDead):
            await aengine.reserve(Request("late-reserve", [1, 2, 3], GREEDY))
        aengine.stop()
        return reasons, errors

    reasons, errors = asyncio.run(run())
    assert len(reasons) == 1 and "device lost" in reasons[0]
    assert errors and "device lost" in errors[0]


# ---------------------------------------------------------------- real processes
@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    with standard_stack(model_dir, tmp_path_factory.mktemp("admission"),
                        decode_args=("--max-num-seqs", "1", "--max-waiting-requests", "1",
                                     "--num-blocks", "64", "--max-request-kv-share", "0.5"),
                        gateway_args=("--max-in-flight", "2")) as s:
        yield s


def _decode(s):
    return next(p for p in s.procs if p.name == "decode")


def _long_body(max_tokens: int = 400) -> dict:
    return {"prompt": "Count: one, two, three,", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}


def test_a_full_decode_queue_is_resource_exhausted_with_retry_after(stack):
    """Straight to the decode worker: one runs, one waits, the third is refused at once."""
    async def run():
        async with grpc.aio.insecure_channel(_decode(stack).address) as ch:
            stub = pb_grpc.DecodeWorkerStub(ch)
            params = pb.SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
            def decode(rid):
                return stub.Decode(pb.DecodeRequest(request_id=rid, prompt_token_ids=[1, 2, 3],
                                                    params=params, local_prefill=True), timeout=60)
            calls = [decode("q0")]
            await calls[0].read()                          # q0 runs
            calls.append(decode("q1"))

            async def q1_waits() -> bool:
                return (await stub.Stats(pb.StatsRequest(), timeout=10)).waiting >= 1
            await wait_until_async(q1_waits, 30, "q1 waiting", interval_s=0.1)
            third = decode("q2")
            t0 = time.perf_counter()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await third.read()
            took = time.perf_counter() - t0
            trailers = dict(await third.trailing_metadata() or ())
            for c in calls:
                c.cancel()
            return e.value, took, trailers

    err, took, trailers = asyncio.run(run())
    wait_idle(_decode(stack))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    assert "max-waiting-requests 1" in err.details()
    assert trailers.get("retry-after") == "1" and took < 5


def test_out_of_vocabulary_prompts_are_invalid_on_the_worker(stack):
    async def run():
        async with grpc.aio.insecure_channel(_decode(stack).address) as ch:
            call = pb_grpc.DecodeWorkerStub(ch).Decode(pb.DecodeRequest(
                request_id="oov", prompt_token_ids=[1, 2 ** 31], local_prefill=True,
                params=pb.SamplingParams(max_tokens=2)), timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            return e.value

    err = asyncio.run(run())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in err.details()


def test_a_request_over_its_kv_share_gets_a_400_naming_the_flag(stack):
    # 64 blocks of 16 tokens, at most half for one request: 300 prompt + 400 output > 512
    r = httpx.post(stack.procs[-1].http + "/v1/completions",
                   json={"prompt": [1] * 300, "max_tokens": 400}, timeout=60)
    assert r.status_code == 400, r.text
    assert "max-request-kv-share" in r.json()["error"]["message"]


def test_a_batch_larger_than_max_in_flight_gets_a_400_naming_the_flag(stack):
    """--max-in-flight 2: three prompts could never be admitted together (not a 429 to retry);
    a request within the bound is served. (One prompt: two at once could both wait on the
    decode worker, whose --max-waiting-requests 1 refuses the second, a retryable 429 that a
    loaded machine makes likely.)"""
    base = stack.procs[-1].http
    r = httpx.post(base + "/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert "--max-in-flight 2" in r.json()["error"]["message"] and "retry-after" not in r.headers
    assert r.json()["error"]["param"] == "prompt"
    r = httpx.post(base + "/v1/completions", json={"prompt": ["a"], "max_tokens": 2,
                                                   "temperature": 0}, timeout=120)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text


def test_the_gateway_bound_answers_429_with_retry_after_and_recovers(stack):
    """--max-in-flight 2: two streams hold the slots (one runs on the decode worker, one waits
    there), a third is refused at once; once they end, requests are served again."""
    base = stack.procs[-1].http
    release = threading.Event()
    results = []

    def stream():
        with httpx.stream("POST", base + "/v1/completions", json=_long_body(480),
                          timeout=120) as r:
            results.append(r.status_code)
            release.wait(120)                         # hold the slot until the check is done

    def in_flight() -> float:
        text = httpx.get(base + "/metrics", timeout=10).text
        return next(float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith("pdserve_requests_in_flight "))

    threads = [threading.Thread(target=stream) for _ in range(2)]
    threads[0].start()
    try:
        # the second once the first runs: sent together, both could reach the decode worker's
        # queue at once, where --max-waiting-requests 1 refuses one of them (a retryable 429)
        wait_until(lambda: worker_stats(_decode(stack)).running >= 1, 60, "the first stream runs",
                   interval_s=0.05)
        threads[1].start()
        wait_until(lambda: in_flight() >= 2, 60,     # both admitted (one waits for the worker)
                   lambda: f"both streams in flight: {in_flight()}, answers: {results}",
                   interval_s=0.1)
        r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       timeout=30)
        metrics = httpx.get(base + "/metrics", timeout=10).text
    finally:
        release.set()
        for t in threads:
            if t.ident is not None:            # started
                t.join(120)
    assert results == [200, 200]
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "overloaded"
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert "pdserve_requests_overloaded_total 1.0" in metrics
    wait_idle(_decode(stack))
    ok = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                    "temperature": 0}, timeout=120)
    assert ok.status_code == 200, ok.text


def test_a_huge_prompt_is_tokenized_off_the_event_loop(stack):
    """While a prompt of ~4 MB is tokenized (seconds), /health still answers at once.

    Relations a busy host leaves true (it slows the tokenizing and the answers alike): the
    answers are timed once the client has sent the whole body (reading it and parsing its JSON
    are the event loop's work), on one open connection (no client set up per answer), and none
    may take half the request's time; were the prompt tokenized on the event loop, one answer
    would wait for all of it."""
    base = stack.procs[-1].http
    body = json.dumps({"prompt": "the quick brown fox jumps over the lazy dog " * 90_000,
                       "max_tokens": 1}).encode()
    sent = threading.Event()
    done = {}

    def chunks():
        step = 1 << 16
        for i in range(0, len(body), step):
            yield body[i:i + step]
        sent.set()                                       # the last chunk went out

    def big():
        t0 = time.perf_counter()
        try:
            r = httpx.post(base + "/v1/completions", content=chunks(), timeout=600,
                           headers={"content-type": "application/json"})
            done["status"] = r.status_code
        finally:
            done["took"] = time.perf_counter() - t0

    t = threading.Thread(target=big)
    latencies = []
    with httpx.Client(base_url=base, timeout=600) as probe:
        probe.get("/health")                             # connected before the request
        t.start()
        wait_until(lambda: sent.is_set() or not t.is_alive(), 600, "the huge prompt sent",
                   interval_s=0.01)
        while t.is_alive() and len(latencies) < 20:
            t0 = time.perf_counter()
            probe.get("/health")
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.05)                             # the pace of the samples, not a wait
    t.join(600)
    assert done.get("status") == 400, done               # far longer than the context
    assert latencies, "the huge prompt was refused before /health could be asked"
    assert max(latencies) < done["took"] / 2, (latencies, done)


def _serve_then_fail(tiny_model_dir, error: Exception, probe_fails: bool = False,
                     monkeypatch=None):
    """A running request, then a step raising `error`: (reasons the engine died for, the
    running request's outputs' errors, whether a later request was served)."""
    import engine.device_faults as faults

    if probe_fails:
        def dead_device(device):
            raise RuntimeError("CUDA error: unspecified launch failure (probe)")
        monkeypatch.setattr(faults, "probe_device", dead_device)

    async def run():
        died = asyncio.Event()
        reasons = []
        aengine = AsyncEngine(engine(tiny_model_dir, num_blocks=256),
                              on_death=lambda r: (reasons.append(r), died.set()))
        aengine.start()
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        running = await aengine.add(Request("running", [1, 2, 3], long))
        await running.get()
        step, calls = aengine.engine.step, []

        def failing_step():
            calls.append(1)
            if len(calls) == 1:
                raise error
            return step()
        aengine.engine.step = failing_step
        errors = []
        while True:
            out = await asyncio.wait_for(running.get(), 10)
            if out.error:
                errors.append(out.error)
                break
        served = False
        try:
            later = await aengine.add(Request("later", [4, 5, 6], GREEDY))
            while True:
                out = await asyncio.wait_for(later.get(), 10)
                if out.error or out.finished:
                    served = not out.error
                    break
        except EngineDead:
            pass
        aengine.stop()
        return reasons, errors, served

    return asyncio.run(run())


def test_a_sticky_device_error_ends_the_engine(tiny_model_dir):
    """An illegal memory access leaves the CUDA context unusable: the engine stops (the worker
    goes NOT_SERVING and is restarted) instead of failing every later step."""
    err = RuntimeError("CUDA error: an illegal memory access was encountered")
    reasons, errors, served = _serve_then_fail(tiny_model_dir, err)
    assert len(reasons) == 1 and "illegal memory access" in reasons[0]
    assert "device is unusable" in reasons[0]
    assert errors and "illegal memory access" in errors[0] and not served


def test_an_error_the_device_does_not_survive_ends_the_engine(tiny_model_dir, monkeypatch):
    """An error of unknown kind after which the device fails its probe: the engine stops."""
    reasons, errors, served = _serve_then_fail(tiny_model_dir, RuntimeError("cuBLAS failed"),
                                               probe_fails=True, monkeypatch=monkeypatch)
    assert len(reasons) == 1 and "cuBLAS failed" in reasons[0] and "probe" in reasons[0]
    assert errors and not served


def test_a_plain_step_error_fails_only_its_batch(tiny_model_dir):
    """An error that leaves the device working fails the running batch; the engine serves the
    next request."""
    reasons, errors, served = _serve_then_fail(tiny_model_dir, ValueError("one bad row"))
    assert reasons == [] and errors and "one bad row" in errors[0] and served
