"""Tiny random MoE checkpoints of every MoE family, built offline by transformers (no hub):
HF's model is the reference the engine is compared against."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

BASE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
            tie_word_embeddings=False, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
# family -> (model_type, HF config); 6 experts (not a power of two, splits 2 and 3 ways),
# top-2, expert widths not powers of two either
FAMILIES = {
    "mixtral": dict(architectures=["MixtralForCausalLM"], intermediate_size=48,
                    num_local_experts=6, num_experts_per_tok=2, rope_theta=1e6),
    "qwen2_moe": dict(architectures=["Qwen2MoeForCausalLM"], intermediate_size=80,
                      moe_intermediate_size=40, shared_expert_intermediate_size=56,
                      num_experts=6, num_experts_per_tok=2, decoder_sparse_step=1,
                      mlp_only_layers=[1], norm_topk_prob=False),
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], intermediate_size=80, head_dim=32,
                      moe_intermediate_size=40, num_experts=6, num_experts_per_tok=2,
                      norm_topk_prob=True),
    "olmoe": dict(architectures=["OlmoeForCausalLM"], intermediate_size=40, num_experts=6,
                  num_experts_per_tok=2, clip_qkv=3.0),
    "glm4_moe": dict(architectures=["Glm4MoeForCausalLM"], intermediate_size=80,
                     moe_intermediate_size=40, n_routed_experts=6, num_experts_per_tok=2,
                     n_group=3, topk_group=2, first_k_dense_replace=1, n_shared_experts=1,
                     routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True,
                     attention_bias=True, head_dim=32, partial_rotary_factor=0.5),
    "minimax_m2": dict(architectures=["MiniMaxM2ForCausalLM"], intermediate_size=40,
                       num_local_experts=6, num_experts_per_tok=2, head_dim=24, rotary_dim=8),
    # sliding and full layers, sinks, YaRN; experts with biases and the clamped SwiGLU
    "gpt_oss": dict(architectures=["GptOssForCausalLM"], intermediate_size=40,
                    num_local_experts=6, num_experts_per_tok=2, head_dim=16, sliding_window=7,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    swiglu_limit=1.5,
                    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0,
                                         beta_fast=32.0, beta_slow=1.0, truncate=False,
                                         original_max_position_embeddings=64)),
}


def make_moe(path: Path, family: str, fused: bool = False, **overrides):
    """HF's model of `family` with random weights saved to `path` (fused: the 3-D expert
    tensors transformers 5 holds, instead of save_pretrained's per-expert ones)."""
    spec = {**BASE, **FAMILIES[family], **overrides}
    cfg = AutoConfig.for_model(family, **spec)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():   # random biases, norms and router biases so every weight matters
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0, 0.5 if "norm" in name else 0.1).add_(1.0 if "norm" in name else 0)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    hf.save_pretrained(path)
    if fused:
        for f in Path(path).glob("*.safetensors"):
            f.unlink()
        save_file({k: v.contiguous() for k, v in hf.state_dict().items()},
                  str(Path(path) / "model.safetensors"))
    return hf
