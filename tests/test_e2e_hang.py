"""Hung workers, with real processes behind the real gateway at its default settings: two prefill
and two decode workers, one of them stopped (SIGSTOP: alive, sockets open, silent, as a stuck
device or a host swapping would be). The gateway's probe (gateway/liveness.py) finds it within
seconds: the streams on a hung decode worker move to the other one token-exact, a prompt waiting
on a hung prefill worker runs on the other one, and the worker, resumed, frees every block and is
routed to again. A worker that is busy, not hung, keeps its requests."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.stack import gateway_sees_workers, metric, standard_stack, wait_idle, wait_until
from tests.test_e2e import hf, hf_greedy, prompt_ids  # noqa: F401  (module fixture)
from tests.test_e2e_faults import long_prompt

pytestmark = pytest.mark.slow

WORKERS = ("prefill-a", "prefill-b", "decode-a", "decode-b")
NEW = 96
# A hang must cost seconds, not gRPC keepalive's minute: the probe answers within 5 s, then the
# stream is computed again elsewhere. The bound leaves room for a loaded two-core host.
MAX_STALL_S = 30.0


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    with standard_stack(model_dir, tmp_path_factory.mktemp("hang"), prefills=WORKERS[:2],
                        decodes=WORKERS[2:],
                        prefill_args=("--max-num-batched-tokens", "256")) as s:
        yield s


def _stream(base: str, ids: list[int], out: dict, new: int = NEW) -> None:
    """A streamed greedy completion; `out` gets the text pieces with their arrival times."""
    out["pieces"] = []
    with httpx.stream("POST", f"{base}/v1/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct", "prompt": ids, "max_tokens": new,
            "temperature": 0, "stream": True}) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                body = json.loads(line[6:])
                if "error" in body:
                    out["error"] = body["error"]
                    continue
                text = body["choices"][0]["text"]
                if text:
                    out["pieces"].append((time.monotonic(), text))


def _text(hf, ids, new: int = NEW) -> str:  # noqa: F811
    return hf[0].decode(hf_greedy(hf, ids, new), skip_special_tokens=True)


def _gateway(stack) -> str:
    return stack.proc("gateway").http


def test_streams_on_a_hung_decode_worker_move_within_seconds(stack, hf):  # noqa: F811
    prompts = [prompt_ids(hf, chat=[{"role": "user", "content": f"Tell me a long story about "
                                     f"a {thing} that learned to sing."}])
               for thing in ("lighthouse", "glacier", "teapot", "bicycle")]
    outs = [{} for _ in prompts]
    threads = [threading.Thread(target=_stream, args=(_gateway(stack), ids, out))
               for ids, out in zip(prompts, outs)]
    for t in threads:
        t.start()
    wait_until(lambda: all(len(o.get("pieces", ())) >= 3 for o in outs), 120,
               lambda: f"every stream under way: {[len(o.get('pieces', ())) for o in outs]}")
    decodes = [stack.proc(n) for n in WORKERS[2:]]
    victim = max(decodes, key=lambda p: metric(p.metrics, "pdserve_requests_running"))
    os.kill(victim.popen.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        for t in threads:
            t.join(180)
    finally:
        os.kill(victim.popen.pid, signal.SIGCONT)
    gaps = []
    for ids, out in zip(prompts, outs):
        assert out["status"] == 200 and "error" not in out, out
        assert "".join(text for _, text in out["pieces"]) == _text(hf, ids)
        after = [at for at, _ in out["pieces"] if at > stopped]
        if after:
            gaps.append(after[0] - stopped)
    gw = _gateway(stack) + "/metrics"
    assert metric(gw, "pdserve_workers_hung_total", role="decode") == 1
    assert metric(gw, "pdserve_stream_migrations_total") >= 1
    assert max(gaps) < MAX_STALL_S, gaps
    # resumed: it lets go of the streams it lost, and is routed to again once it answers
    wait_idle(*[stack.proc(n) for n in WORKERS])
    before = metric(victim.metrics, "pdserve_generated_tokens_total")
    sent = []

    def served_again() -> bool:
        # prompts no worker holds: ties of load go round-robin, not to a cached prefix
        sent.append(len(sent))
        r = httpx.post(f"{_gateway(stack)}/v1/completions", timeout=60, json={
            "model": "SmolLM2-135M-Instruct", "prompt": f"{len(sent)} plus {len(sent)} is",
            "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        return metric(victim.metrics, "pdserve_generated_tokens_total") > before
    wait_until(served_again, 60, lambda: f"the resumed decode worker serving again "
                                         f"({len(sent)} requests sent)")
    wait_idle(*[stack.proc(n) for n in WORKERS])


def test_a_prompt_on_a_hung_prefill_worker_runs_on_the_other_one(stack, hf):  # noqa: F811
    ids = long_prompt(hf[0], "harbours")
    out: dict = {}
    t = threading.Thread(target=_stream, args=(_gateway(stack), ids, out))
    t.start()
    prefills = [stack.proc(n) for n in WORKERS[:2]]
    wait_until(lambda: any(metric(p.metrics, "pdserve_requests_running") for p in prefills),
               60, "a prefill worker computing the prompt")
    victim = next(p for p in prefills if metric(p.metrics, "pdserve_requests_running"))
    os.kill(victim.popen.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        t.join(180)
    finally:
        os.kill(victim.popen.pid, signal.SIGCONT)
    assert out["status"] == 200 and "error" not in out, out
    assert "".join(text for _, text in out["pieces"]) == _text(hf, ids)
    assert out["pieces"][0][0] - stopped < MAX_STALL_S
    gw = _gateway(stack) + "/metrics"
    assert metric(gw, "pdserve_workers_hung_total", role="prefill") == 1
    assert metric(gw, "pdserve_request_retries_total") >= 1
    wait_idle(*[stack.proc(n) for n in WORKERS])


def test_a_busy_worker_keeps_its_request(stack, hf):  # noqa: F811
    """A second gateway probes with a 1-second timeout while a prefill worker computes a long
    prompt for longer than that: silent, but answering, so nothing moves."""
    gw2 = stack.start_gateway("--worker-probe-timeout", "1", name="gateway-2")
    try:
        wait_until(lambda: gateway_sees_workers(gw2.http, 2, 2), 60,
                   "every worker at the second gateway", [(gw2.popen, gw2.log)])
        ids = long_prompt(hf[0], "orchards") * 2             # ~2000 tokens
        out: dict = {}
        sent = time.monotonic()
        _stream(gw2.http, ids, out, new=8)
        assert out["status"] == 200 and "error" not in out, out
        assert "".join(text for _, text in out["pieces"]) == _text(hf, ids, 8)
        assert out["pieces"][0][0] - sent > 1.0          # silent for longer than the probe
        m = gw2.http + "/metrics"
        assert metric(m, "pdserve_workers_hung_total") == 0
        assert metric(m, "pdserve_request_retries_total") == 0
    finally:
        gw2.popen.terminate()
        gw2.popen.wait(10)
        stack.procs.remove(gw2)
