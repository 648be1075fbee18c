"""A tiny Gemma 2 (sliding layers between global ones, soft-capped scores and logits) through
the real stack: gateway -> prefill (chunks crossing the window's edge) -> KV transfer -> a
decode pool of two tensor-parallel ranks, greedy text equal to HF's, again from the prefix
cache."""

from __future__ import annotations


import httpx
import pytest

from tests.stack import copy_tokenizer, metric, standard_stack, wait_idle
from tests.test_attention_families import make_model
from tests.test_e2e import hf, hf_greedy  # noqa: F401  (module fixture)
from tests.test_e2e_transports import STORY

pytestmark = pytest.mark.slow

NEW = 16
NAME = ("--served-model-name", "tiny-gemma")


@pytest.fixture(scope="module")
def tiny_gemma(model_dir, tmp_path_factory):
    """A random Gemma 2 with the default model's tokenizer (its vocabulary), window 16."""
    d = tmp_path_factory.mktemp("tiny-gemma")
    model = make_model(d, "gemma2", vocab_size=49152, max_position_embeddings=2048,
                       sliding_window=16)
    copy_tokenizer(model_dir, d)
    return d, model


def complete(base: str, ids: list[int]) -> str:
    r = httpx.post(f"{base}/v1/completions", timeout=300, json={
        "model": "tiny-gemma", "prompt": ids, "max_tokens": NEW, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_sliding_family_through_the_stack_is_hf_greedy(tiny_gemma, hf, tmp_path):  # noqa: F811
    d, model = tiny_gemma
    tok = hf[0]
    flags = (*NAME, "--max-num-batched-tokens", "24")
    with standard_stack(d, tmp_path, gateway_args=NAME, prefill_args=flags,
                        decode_args=(*flags, "--tensor-parallel-size", "2")) as s:
        base = s.procs[-1].http
        cases = [tok(STORY * 3).input_ids, tok("Name a large ocean.").input_ids]
        want = [tok.decode(hf_greedy((tok, model), ids, NEW), skip_special_tokens=True)
                for ids in cases]
        assert len(cases[0]) > 3 * 16                    # the window is a fraction of it
        assert complete(base, cases[0]) == want[0]
        # moved: the global layer's every block, each sliding layer's (a KV group each) from
        # the block its window of the last prompt position starts in
        n = len(cases[0])
        blocks = -(-n // 16)
        moved = blocks + 2 * (blocks - (n - 16) // 16)
        assert metric(s.proc("decode").metrics, "pdserve_kv_transfer_blocks_total") == moved
        assert complete(base, cases[1]) == want[1]
        assert complete(base, cases[0]) == want[0]      # again: from the prefix cache
        assert metric(s.proc("prefill").metrics, "pdserve_prefix_cache_hits_tokens_total") > 0
        wait_idle(s.proc("prefill"), s.proc("decode"), timeout_s=10)
