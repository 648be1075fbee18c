"""Our model code against HF transformers on tiny random-weight configs (exact logits, fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.request import Request, SamplingParams
from pdserve.gpucheck import engine_logits
from tests.cpu_paths import attention_params, linear_params

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-6, tie_word_embeddings=False)
FAMILIES = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], rope_theta=10000.0),
    "llama3-rope": dict(model_type="llama", architectures=["LlamaForCausalLM"], rope_theta=500000.0,
                        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0,
                                          original_max_position_embeddings=64)),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], rope_theta=1e6),
    "qwen3-yarn": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=32,
                       rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0,
                                            original_max_position_embeddings=32),
                       tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=32,
                  rope_theta=1e6, tie_word_embeddings=True),
}


def make_model(tmp_path, family: str):
    spec = dict(TINY, **FAMILIES[family])
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():   # random biases and norms so every weight matters
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0, 0.5 if "norm" in name else 0.1).add_(1.0 if "norm" in name else 0)
    hf.save_pretrained(tmp_path)
    return hf


@pytest.mark.parametrize("attention", attention_params(head_dim=16, block_size=4))
@pytest.mark.parametrize("linear", linear_params())
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_hf(tmp_path, family, linear, attention):
    """On every CPU path this host runs (--linear-method x --cpu-attention)."""
    hf = make_model(tmp_path, family)
    mc = ModelConfig.from_dir(tmp_path)
    assert mc.attention_bias == (family == "qwen2")
    assert mc.qk_norm == family.startswith("qwen3")
    eng = Engine(tmp_path, EngineConfig(num_blocks=32, block_size=4, max_num_batched_tokens=64,
                                        linear_method=linear, cpu_attention=attention), mc)
    want = {"torch": "dense"}.get(linear, linear)
    assert {m.method.name for m in eng.model.modules() if hasattr(m, "method")} == {want}
    assert eng.runner.backend.kernel == (attention == "avx2")
    ids = torch.randint(0, 128, (1, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0]                                          # [37, vocab]
    # chunked prefill across steps (budget 16) through the paged cache, logits of every position
    got = engine_logits(eng, ids[0].tolist())
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attention", attention_params(head_dim=16, block_size=4))
@pytest.mark.parametrize("linear", linear_params())
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_generate_matches_hf(tmp_path, family, linear, attention):
    hf = make_model(tmp_path, family)
    eng = Engine(tmp_path, EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=8,
                                        linear_method=linear, cpu_attention=attention))
    prompts = [[5, 9, 17, 3, 3, 100, 41], [7] * 13, [1, 2, 3]]
    for i, p in enumerate(prompts):
        eng.add_request(Request(str(i), p, SamplingParams(temperature=0, max_tokens=20,
                                                          ignore_eos=True)))
    got: dict[str, list[int]] = {}
    while eng.has_work():
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    for i, p in enumerate(prompts):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert got[str(i)] == ref
    assert eng.pool.num_free == eng.pool.num_blocks


def test_bf16_weights_computed_in_fp32_match_hf_on_rounded_weights(tmp_path):
    """--dtype bfloat16 --compute-dtype float32: a bf16 model's weights, fp32 arithmetic."""
    hf = make_model(tmp_path, "llama")
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    cfg = EngineConfig(num_blocks=32, block_size=4, dtype="bfloat16", compute_dtype="float32")
    assert cfg.torch_dtype == torch.float32 and cfg.weight_dtype == torch.bfloat16
    eng = Engine(tmp_path, cfg)
    assert eng.layout.dtype == "float32"
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits[0, -1]
    req = Request("r", ids[0].tolist(), SamplingParams(temperature=0, max_tokens=1, logprobs=True))
    eng.add_request(req)
    outs = []
    while eng.has_work():
        outs += eng.step()
    assert outs[-1].new_token_ids == [int(ref.argmax())]
    assert abs(outs[-1].new_logprobs[0].logprob - float(ref.log_softmax(-1).max())) < 1e-4


def test_compute_dtype_resolution(monkeypatch):
    import engine.config as ec

    monkeypatch.setattr(ec, "_cpu_flags", lambda: {"avx2", "fma"})
    assert ec.resolve_compute_dtype("bfloat16", "auto", "cpu") == "float32"
    assert ec.resolve_compute_dtype("bfloat16", "bfloat16", "cpu") == "bfloat16"
    assert ec.resolve_compute_dtype("bfloat16", "auto", "cuda:0") == "bfloat16"
    assert ec.resolve_compute_dtype("float32", "auto", "cpu") == "float32"
    monkeypatch.setattr(ec, "_cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert ec.resolve_compute_dtype("bfloat16", "auto", "cpu") == "bfloat16"
    assert ec.resolve_compute_dtype("float16", "auto", "cpu") == "float32"
    with pytest.raises(ValueError, match="compute_dtype"):
        ec.resolve_compute_dtype("float32", "int8", "cpu")
