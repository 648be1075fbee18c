"""Tensor-parallel workers through the real stack (gloo ranks on CPU, one thread each), with
unequal sizes on the two sides: the KV crosses with every head and each side maps it to its
ranks. Greedy tokens are HF's; every rank's pool ends all free."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.stack import metric, standard_stack, wait_idle
from tests.test_e2e import hf, hf_greedy  # noqa: F401  (module fixture)
from tests.test_e2e_transports import STORY, complete

pytestmark = pytest.mark.slow

NEW = 12


def _check(s, tok, reference, cases) -> None:
    base = s.procs[-1].http
    for ids in cases:
        assert complete(base, ids) == tok.decode(reference(ids), skip_special_tokens=True)
    wait_idle(s.proc("prefill"), s.proc("decode"), timeout_s=10)


def test_decode_tp3_behind_tp1_prefill_is_hf_greedy(model_dir, tmp_path, hf):  # noqa: F811
    """The default model's 9 query and 3 KV heads split three ways (one KV head per rank), its
    KV pushed by a TP=1 prefill worker over the torch transport, in several chunks."""
    tok = hf[0]
    flags = ("--kv-transport", "torch", "--max-num-batched-tokens", "128")
    with standard_stack(model_dir, tmp_path, prefill_args=flags,
                        decode_args=(*flags, "--tensor-parallel-size", "3")) as s:
        cases = [tok(STORY * 6 + "What did the keeper write?").input_ids,
                 tok("Name a large ocean.").input_ids]
        _check(s, tok, lambda ids: hf_greedy(hf, ids, NEW), cases)
        assert metric(s.proc("decode").metrics, "pdserve_kv_transfers_total",
                      transport="torch") == len(cases)
        assert "tensor parallel: 3 ranks" in s.proc("decode").log.read_text()


@pytest.fixture(scope="module")
def tiny_even_heads(model_dir, tmp_path_factory):
    """A random Llama with 4 query and 2 KV heads (even over 2 ranks) and the default model's
    tokenizer, saved as an HF folder; the HF model itself."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    d = tmp_path_factory.mktemp("tiny-tp")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.2)             # sharp logits: no near-ties in greedy
    model.save_pretrained(d)
    for f in model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "vocab.json" \
                or f.name == "merges.txt":
            shutil.copy(f, d / f.name)
    return d, model


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_unequal_tp_is_hf_greedy(tiny_even_heads, hf, tmp_path,  # noqa: F811
                                 prefill_tp, decode_tp):
    d, model = tiny_even_heads
    tok = hf[0]
    name = ("--served-model-name", "SmolLM2-135M-Instruct")     # what `complete` asks for
    flags = (*name, "--max-num-batched-tokens", "64")
    with standard_stack(d, tmp_path, gateway_args=name,
                        prefill_args=(*flags, "--tensor-parallel-size", str(prefill_tp)),
                        decode_args=(*flags, "--tensor-parallel-size", str(decode_tp))) as s:
        cases = [tok(STORY * 2).input_ids, tok("Name a large ocean.").input_ids]

        def reference(ids):
            return hf_greedy((tok, model), ids, NEW)
        _check(s, tok, reference, cases)
        for role, n in (("prefill", prefill_tp), ("decode", decode_tp)):
            assert (f"tensor parallel: {n} ranks" in s.proc(role).log.read_text()) == (n > 1)
