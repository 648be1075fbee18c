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


def test_phi3_longrope_through_the_stack_is_hf_greedy(model_dir, tmp_path):
    """LongRoPE across prefill -> KV transfer -> decode: a prompt past the original context
    (long factors on both workers), and one within it whose generation crosses it (the decode
    worker computes it again with the long factors, as HF does)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.test_attention_families import LONGROPE, TINY
    from tests.test_lora import hf_greedy

    d = tmp_path / "tiny-phi3"
    spec = {**TINY, **LONGROPE, "vocab_size": 49152, "original_max_position_embeddings": 32}
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    cfg.initializer_range = 0.2
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hf.save_pretrained(d)
    copy_tokenizer(model_dir, d)
    name = ("--served-model-name", "tiny-phi3")
    flags = (*name, "--max-num-batched-tokens", "16")
    cases = [list(range(300, 340)), list(range(500, 520))]     # 40 tokens; 20 (+16 past 32)
    with standard_stack(d, tmp_path, gateway_args=name, prefill_args=flags,
                        decode_args=flags) as s:
        base = s.procs[-1].http
        for ids in cases:
            r = httpx.post(f"{base}/v1/completions", timeout=300, json={
                "model": "tiny-phi3", "prompt": ids, "max_tokens": NEW, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == hf_greedy(hf, ids, NEW)
        assert metric(s.proc("decode").metrics, "pdserve_kv_transfer_blocks_total") > 0
        wait_idle(s.proc("prefill"), s.proc("decode"), timeout_s=10)
