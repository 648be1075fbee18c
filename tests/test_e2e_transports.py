"""Greedy parity with HF through the real stack over the `nixl` and `torch` KV transports (the
`grpc` one is the default of tests/test_e2e.py), with prompts long enough to be streamed in
several chunks; both pools end all free."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.stack import metric, standard_stack, wait_idle
from tests.test_e2e import hf, hf_greedy  # noqa: F401  (module fixture)

pytestmark = pytest.mark.slow

NEW = 12
STORY = ("The lighthouse keeper climbed the stairs every evening, counted the steps, and wrote "
         "the number in a small book. ")


def prompts(tok) -> list[list[int]]:
    long_ids = tok(STORY * 12 + "What did the keeper write?").input_ids     # ~300 tokens
    return [long_ids, tok("Name a large ocean.").input_ids]


def complete(base: str, ids: list[int]) -> list[int]:
    r = httpx.post(f"{base}/v1/completions", timeout=300, json={
        "model": "SmolLM2-135M-Instruct", "prompt": ids, "max_tokens": NEW, "temperature": 0,
        "logprobs": 1})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("transport", ["nixl", "torch"])
def test_greedy_parity_with_hf_over_transport(transport, model_dir, tmp_path, hf):  # noqa: F811
    tok = hf[0]
    flags = ("--kv-transport", transport, "--max-num-batched-tokens", "128")
    with standard_stack(model_dir, tmp_path, decode_args=flags, prefill_args=flags) as s:
        base = s.procs[-1].http
        cases = prompts(tok)
        with ThreadPoolExecutor(len(cases)) as ex:
            got = list(ex.map(lambda ids: complete(base, ids), cases))
        for ids, text in zip(cases, got):
            assert text == tok.decode(hf_greedy(hf, ids, NEW), skip_special_tokens=True)
        decode = s.proc("decode").metrics
        assert metric(decode, "pdserve_kv_transfers_total", transport=transport) == len(cases)
        prefill = s.proc("prefill").metrics
        assert metric(prefill, "pdserve_kv_transfer_bytes_total", transport=transport) > 0
        wait_idle(s.proc("prefill"), s.proc("decode"), timeout_s=10)
