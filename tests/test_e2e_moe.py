"""A tiny MoE model (Qwen2-MoE: routed experts, a gated shared expert, a dense layer) through the
real stack: gateway -> prefill -> KV transfer -> decode, greedy text equal to HF's with the
prefix cache and n-gram speculation on; then a decode pool of two expert-parallel ranks behind
a one-process prefill pool. The workers' start lines name the MoE shape and /metrics counts the
tokens each expert computed."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.moe_models import make_moe
from tests.stack import copy_tokenizer, metric, standard_stack, wait_idle
from tests.test_e2e import hf, hf_greedy  # noqa: F401  (module fixture)
from tests.test_e2e_transports import STORY

pytestmark = pytest.mark.slow

NEW = 16
NAME = ("--served-model-name", "tiny-moe")


@pytest.fixture(scope="module")
def tiny_moe(model_dir, tmp_path_factory):
    """A random Qwen2-MoE with the default model's tokenizer (its vocabulary), as an HF folder;
    the HF model itself."""
    d = tmp_path_factory.mktemp("tiny-moe")
    model = make_moe(d, "qwen2_moe", vocab_size=49152, max_position_embeddings=2048)
    copy_tokenizer(model_dir, d)
    return d, model


def complete(base: str, ids: list[int]) -> str:
    r = httpx.post(f"{base}/v1/completions", timeout=300, json={
        "model": "tiny-moe", "prompt": ids, "max_tokens": NEW, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _expert_tokens(url: str, layer: int) -> float:
    return sum(metric(url, "pdserve_moe_expert_tokens_total", layer=str(layer), expert=str(e))
               for e in range(6))


def test_moe_through_the_stack_is_hf_greedy(tiny_moe, hf, tmp_path):  # noqa: F811
    d, model = tiny_moe
    tok = hf[0]
    flags = (*NAME, "--max-num-batched-tokens", "64")
    with standard_stack(d, tmp_path, gateway_args=NAME, prefill_args=flags,
                        decode_args=(*flags, "--speculative", "ngram",
                                     "--num-speculative-tokens", "3")) as s:
        base = s.procs[-1].http
        cases = [tok(STORY * 2).input_ids, tok("Name a large ocean.").input_ids]
        with ThreadPoolExecutor(len(cases)) as ex:
            got = list(ex.map(lambda ids: complete(base, ids), cases))
        want = [tok.decode(hf_greedy((tok, model), ids, NEW), skip_special_tokens=True)
                for ids in cases]
        assert got == want
        assert complete(base, cases[0]) == want[0]          # again: from the prefix cache
        prefill, decode = s.proc("prefill").metrics, s.proc("decode").metrics
        assert metric(prefill, "pdserve_prefix_cache_hits_tokens_total") > 0
        assert metric(decode, "pdserve_spec_proposed_tokens_total", proposer="ngram") > 0
        # layer 1 is dense (mlp_only_layers); the prompts' tokens went through layers 0 and 2
        assert _expert_tokens(prefill, 0) >= 2 * sum(len(c) for c in cases)
        assert _expert_tokens(decode, 2) > 0
        assert "pdserve_moe_expert_tokens_total{" in httpx.get(decode).text
        assert 'layer="1"' not in httpx.get(decode).text
        assert "MoE: 6 experts, top-2" in s.proc("decode").log.read_text()
        wait_idle(s.proc("prefill"), s.proc("decode"), timeout_s=10)


def test_expert_parallel_decode_behind_one_process_prefill(tiny_moe, hf, tmp_path):  # noqa: F811
    """Different TP/EP sizes on the two sides: the KV crosses with every head; the decode
    pool's two ranks hold three experts each."""
    d, model = tiny_moe
    tok = hf[0]
    flags = (*NAME, "--max-num-batched-tokens", "64")
    with standard_stack(d, tmp_path, gateway_args=NAME, prefill_args=flags,
                        decode_args=(*flags, "--tensor-parallel-size", "2",
                                     "--expert-parallel")) as s:
        base = s.procs[-1].http
        cases = [tok(STORY).input_ids, tok("Name a large ocean.").input_ids]
        for ids in cases:
            assert complete(base, ids) == tok.decode(hf_greedy((tok, model), ids, NEW),
                                                     skip_special_tokens=True)
        log = s.proc("decode").log.read_text()
        assert "expert parallel 2: 3 experts on rank 0" in log
        assert _expert_tokens(s.proc("decode").metrics, 0) >= 2 * (NEW - 1) * len(cases)
        wait_idle(s.proc("prefill"), s.proc("decode"), timeout_s=10)
