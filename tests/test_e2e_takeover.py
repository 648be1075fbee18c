"""A decode worker that gives up on a prompt's KV and computes the prompt itself
(--kv-load-failure recompute) keeps the request, through the real gateway with real processes,
on each KV transport: for KV that did not arrive in time (the prefill worker is stopped) and for
KV refused as corrupted (the prefill worker's checksums are off: tests/corrupt_checksums). The
decode worker says so on its stream, the gateway ends the prefill worker's call and ignores its
failure: the client gets HF's greedy tokens on the first attempt, and no KV block leaks on
either worker once the prefill worker runs again."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest

from tests.stack import ROOT, metric, standard_stack, wait_idle, wait_until
from tests.test_e2e import hf, hf_greedy  # noqa: F401  (module fixture)
from tests.test_e2e_faults import long_prompt

pytestmark = pytest.mark.slow

NEW = 12
CORRUPTING = ROOT / "tests" / "corrupt_checksums"


@pytest.fixture(scope="module", params=["grpc", "nixl", "torch"])
def stack(request, model_dir, tmp_path_factory):
    transport = ("--kv-transport", request.param)
    decode = ("--kv-transfer-timeout", "3", "--kv-load-failure", "recompute", *transport)
    prefill = ("--kv-transfer-timeout", "5", "--max-num-batched-tokens", "256", *transport)
    path = os.pathsep.join(filter(None, [str(CORRUPTING), str(ROOT),
                                         os.environ.get("PYTHONPATH")]))
    with standard_stack(model_dir, tmp_path_factory.mktemp(f"takeover-{request.param}"),
                        decode_args=decode, prefill_args=prefill,
                        prefill_env={"PYTHONPATH": path}) as s:
        yield s


def _prompt(hf, topic: str) -> list[int]:  # noqa: F811
    return hf[0](f"A short note on {topic}, written for a school newsletter: "
                 "the facts first, then one question for the readers.").input_ids


def _complete(stack, ids: list[int]) -> httpx.Response:
    return httpx.post(f"{stack.procs[-1].http}/v1/completions", timeout=120, json={
        "model": "SmolLM2-135M-Instruct", "prompt": ids, "max_tokens": NEW, "temperature": 0,
        "ignore_eos": True})


def _counts(stack) -> dict[str, float]:
    gw, d = stack.procs[-1].http + "/metrics", stack.proc("decode").metrics
    return {"taken_over": metric(gw, "pdserve_prompts_taken_over_total"),
            "retries": metric(gw, "pdserve_request_retries_total"),
            "hung": metric(gw, "pdserve_workers_hung_total"),
            "timeouts": metric(d, "pdserve_kv_transfer_failures_total", kind="timeout"),
            "checksum": metric(d, "pdserve_kv_checksum_failures_total")}


def _changed(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before if after[k] != before[k]}


def _expect(hf, ids) -> str:  # noqa: F811
    return hf[0].decode(hf_greedy(hf, ids, NEW), skip_special_tokens=True)


def test_kv_refused_as_corrupted_is_computed_on_the_decode_worker(stack, hf):  # noqa: F811
    ids = _prompt(hf, "tides")
    before = _counts(stack)
    r = _complete(stack, ids)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == _expect(hf, ids)
    assert _changed(before, _counts(stack)) == {"taken_over": 1, "checksum": 1}
    wait_idle(stack.proc("prefill"), stack.proc("decode"))


def test_kv_that_did_not_arrive_in_time_is_computed_on_the_decode_worker(stack, hf):  # noqa: F811
    """The prefill worker is stopped once it computes the prompt (its send stream is open, so
    a one-sided sender, resumed, tells the decode worker it wrote nothing more)."""
    ids = long_prompt(hf[0], "comets")
    before = _counts(stack)
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(r=_complete(stack, ids)))
    t.start()
    prefill = stack.proc("prefill")
    wait_until(lambda: metric(prefill.metrics, "pdserve_requests_running") > 0, 60,
               "the prefill worker computing the prompt")
    os.kill(prefill.popen.pid, signal.SIGSTOP)    # alive, silent: its transfer never ends
    try:
        t.join(120)
    finally:
        os.kill(prefill.popen.pid, signal.SIGCONT)
    r = got["r"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == _expect(hf, ids)
    # D's 3-second KV timeout comes before the gateway's 5-second probe of the stopped worker
    assert _changed(before, _counts(stack)) == {"taken_over": 1, "timeouts": 1}
    wait_idle(stack.proc("prefill"), stack.proc("decode"))     # P, resumed, let go too
