"""Families whose attention differs by layer (engine.config.LayerAttention) against HF
transformers on tiny random models: Mistral and Phi-3 (every layer sliding; Phi-3's fused
qkv and gate_up tensors, partial rotary), Gemma 2 (sliding and global
layers alternating, soft-capped scores and logits), Gemma 3 (five sliding layers to one global,
a local rotary base, q/k norms), Qwen2 with use_sliding_window. The windows are shorter than the
prompts and the chunked prefill's chunks cross their edges; fp32 logits of every position, then
greedy tokens of a batch through the engine (decodes grouped, short queries after a cached
prefix)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.request import Request, SamplingParams
from pdserve.gpucheck import engine_logits
from tests.cpu_paths import attention_params, linear_params

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, rms_norm_eps=1e-6)
WINDOW = 7
FAMILIES = {
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"],
                    sliding_window=WINDOW, tie_word_embeddings=False),
    "qwen2-sliding": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                          use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                          tie_word_embeddings=False),
    "phi3": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], sliding_window=WINDOW,
                 partial_rotary_factor=0.5, tie_word_embeddings=False, pad_token_id=0),
    "gemma2": dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"],
                   sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                   final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh",
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "gemma3_text": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
                        sliding_window=WINDOW, query_pre_attn_scalar=24,
                        hidden_activation="gelu_pytorch_tanh",
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                        rope_parameters={"sliding_attention": {"rope_type": "default",
                                                               "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                            "rope_theta": 1e6}}),
}


def make_model(tmp_path, family: str, **overrides):
    spec = {**TINY, **FAMILIES[family], **overrides}
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    cfg.initializer_range = 0.2            # peaked: greedy ties do not flip
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():       # random norms and biases: every weight matters
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    hf.save_pretrained(tmp_path)
    return hf


@pytest.mark.parametrize("attention", attention_params(head_dim=16, block_size=4))
@pytest.mark.parametrize("linear", linear_params())
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_hf_across_the_window(tmp_path, family, linear, attention):
    """On every CPU path this host runs (--linear-method x --cpu-attention: the C++ kernel
    takes the windows, soft-capping and sinks too)."""
    hf = make_model(tmp_path, family)
    mc = ModelConfig.from_dir(tmp_path)
    windows = [mc.attention_of(i).window for i in range(mc.num_layers)]
    want = {"mistral": [WINDOW] * 3, "phi3": [WINDOW] * 3, "qwen2-sliding": [0, WINDOW, WINDOW],
            "gemma2": [WINDOW, 0, WINDOW], "gemma3_text": [WINDOW, WINDOW, 0]}[family]
    assert windows == want
    eng = Engine(tmp_path, EngineConfig(num_blocks=32, block_size=4, max_num_batched_tokens=64,
                                        linear_method=linear, cpu_attention=attention), mc)
    assert eng.runner.backend.kernel == (attention == "avx2")
    ids = torch.randint(0, 128, (1, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0]                                          # [37, vocab]
    got = engine_logits(eng, ids[0].tolist())       # chunks of 16: across the window's edge
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "mistral", "phi3"])
def test_greedy_generate_matches_hf(tmp_path, family):
    """A batch decoded together (grouped decodes under per-layer windows), a prompt whose
    prefix is cached (a short query after it), generation well past the window."""
    hf = make_model(tmp_path, family)
    eng = Engine(tmp_path, EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=8))
    prompts = [[5, 9, 17, 3, 3, 100, 41, 8, 8, 2], [7] * 13, [5, 9, 17, 3, 3, 100, 41, 8, 1]]
    got: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        eng.add_request(Request(str(i), p, SamplingParams(temperature=0, max_tokens=16,
                                                          ignore_eos=True)))
        got[str(i)] = []
    while eng.has_work():
        for o in eng.step():
            got[o.request_id].extend(o.new_token_ids)
    for i, p in enumerate(prompts):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert got[str(i)] == ref, i
    assert eng.pool.num_free == eng.pool.num_blocks


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_the_engines_features_on_layers_that_differ(tmp_path, family):
    """What the engine does around the model, on a model whose layers differ: prompt logprobs
    (Gemma 2's soft-capped logits), n-gram speculation (verification rows past the window),
    beam search (forked tables under sliding layers, sinks), each against HF."""
    from tests.conftest import make_engine
    from tests.moe_models import make_moe
    from tests.test_beam_search import _beam, _hf_beams, _run

    hf = make_model(tmp_path, family) if family != "gpt_oss" else make_moe(tmp_path, family)
    ids = [5, 9, 17, 3, 5, 9, 17, 3, 5, 9, 17, 3, 8, 1]
    with torch.no_grad():
        lp = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    eng = make_engine(tmp_path, num_blocks=64, block_size=4, max_num_batched_tokens=8,
                      speculative="ngram", num_speculative_tokens=3)
    try:
        eng.add_request(Request("p", ids, SamplingParams(temperature=0, max_tokens=20,
                                                         ignore_eos=True, prompt_logprobs=2)))
        scored, tokens = None, []
        while eng.has_work():
            for o in eng.step():
                scored = scored or o.prompt_logprobs
                tokens += o.new_token_ids
        assert [e.logprob for e in scored[1:]] == pytest.approx(
            [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))], abs=1e-4)
        greedy = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert tokens == greedy
        assert eng.stats.spec_proposed > 0
    finally:
        eng.close()
    eng = make_engine(tmp_path, num_blocks=96, block_size=4, max_num_batched_tokens=16)
    try:
        got = _run(eng, [_beam("b", ids, 3, 1.0, False, 10)])
    finally:
        eng.close()
    assert [got[("b", c)][0] for c in range(3)] == _hf_beams((None, hf), ids, 3, 1.0, False, 10)


LONGROPE = dict(model_type="phi3", architectures=["Phi3ForCausalLM"], tie_word_embeddings=False,
                pad_token_id=0, partial_rotary_factor=0.5, original_max_position_embeddings=24,
                rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.3, 1.7, 2.2],
                              "long_factor": [1.0, 3.0, 7.0, 15.0]})


@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_phi3_longrope_switches_factors_as_hf_does(tmp_path, speculative):
    """LongRoPE (Phi-3 128K, Phi-4-mini): a prompt within the original context (24 here) takes
    the short factors and its generation the long ones from position 24 on; a longer prompt
    takes the long ones everywhere (chunked prefill included), and never reuses KV the short
    factors computed (the prefix cache keys them apart)."""
    spec = {**TINY, **LONGROPE}
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    cfg.initializer_range = 0.2
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    mc = ModelConfig.from_dir(tmp_path)
    assert mc.long_rope_after == 24
    eng = Engine(tmp_path, EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=8,
                                        speculative=speculative, num_speculative_tokens=4), mc)
    ids = torch.randint(0, 128, (1, 37), generator=torch.Generator().manual_seed(2))[0]
    short = ids[:20].tolist()

    def generate(prompt, n):
        eng.add_request(Request("g", prompt, SamplingParams(temperature=0, max_tokens=n,
                                                            ignore_eos=True)))
        got = []
        while eng.has_work():
            for o in eng.step():
                got.extend(o.new_token_ids)
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert got == want

    generate(short, 3)                      # within the original context: short factors
    # a longer prompt sharing those 20 tokens: every position long, none of their KV reused
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    hits = eng.kv_manager.hit_tokens
    torch.testing.assert_close(engine_logits(eng, ids.tolist()), ref, rtol=1e-4, atol=1e-4)
    assert eng.kv_manager.hit_tokens == hits
    # generated past it: computed again with the long factors (as HF drops its cache there;
    # proposals never carry a step past it)
    generate(short, 16)
    generate([5, 6, 7, 8] * 5, 16)          # repeats: n-gram proposals near the edge
    assert eng.pool.num_free == eng.pool.num_blocks
