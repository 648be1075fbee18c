"""Speculative decoding through the real stack: with n-gram proposals and with a draft model
(the default model drafting for itself), the decode worker's greedy output equals HF's, for a
prompt whose answer repeats it and a plain question sent together; the decode worker reports
its proposals in /metrics and ends with both pools free. With `--speculative off` (n-gram is
the CPU default) the same answers come without a proposal."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdserve.bench.code_edit import code_edit_texts
from tests.stack import metric, standard_stack, wait_idle
from tests.test_e2e import hf, hf_greedy  # noqa: F401  (module fixture)

pytestmark = pytest.mark.slow

NEW = 40


def complete(base: str, ids: list[int]) -> list[int]:
    r = httpx.post(f"{base}/v1/completions", timeout=300, json={
        "model": "SmolLM2-135M-Instruct", "prompt": ids, "max_tokens": NEW, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("spec", ["ngram", "draft", "off"])
def test_greedy_parity_with_hf_with_speculation(spec, model_dir, tmp_path, hf):  # noqa: F811
    tok = hf[0]
    flag = {"ngram": "ngram", "off": "off"}.get(spec, f"draft:{model_dir}")
    decode_args = ("--speculative", flag, "--num-speculative-tokens", "3")
    with standard_stack(model_dir, tmp_path, decode_args=decode_args) as s:
        base = s.procs[-1].http
        cases = [tok(code_edit_texts(1)[0]).input_ids, tok("Name a large ocean.").input_ids]
        with ThreadPoolExecutor(len(cases)) as ex:
            got = list(ex.map(lambda ids: complete(base, ids), cases))
        for ids, text in zip(cases, got):
            assert text == tok.decode(hf_greedy(hf, ids, NEW), skip_special_tokens=True)
        decode = s.proc("decode").metrics
        if spec == "off":
            assert metric(decode, "pdserve_spec_proposed_tokens_total") == 0
            wait_idle(s.proc("decode"), timeout_s=10)
            return
        proposed = metric(decode, "pdserve_spec_proposed_tokens_total", proposer=spec)
        accepted = metric(decode, "pdserve_spec_accepted_tokens_total", proposer=spec)
        assert proposed > 0 and 0 < accepted <= proposed
        if spec == "draft":           # the target drafting for itself is always right
            assert accepted == proposed
        assert metric(decode, "pdserve_spec_mean_accepted_length", proposer=spec) > 1
        wait_idle(s.proc("decode"), timeout_s=10)
