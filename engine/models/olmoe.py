"""OLMoE: q and k each RMS-normed over all heads at once (before the head split), optional
q/k/v clipping, biases on q/k/v/o when `attention_bias`; every layer an MoE with a softmax
router (`norm_topk_prob` by config)."""

from __future__ import annotations

from engine.config import MoEConfig
from engine.layers.decoder import DecoderLM
from engine.models import MOE_QUANT, Family
from engine.models.qwen2_moe import num_experts


def config(hf: dict) -> dict:
    bias = bool(hf.get("attention_bias", False))
    return dict(qk_norm_across_heads=True, clip_qkv=float(hf.get("clip_qkv") or 0.0),
                attention_bias=bias, o_proj_bias=bias,
                moe=MoEConfig(num_experts=num_experts(hf), top_k=hf["num_experts_per_tok"],
                              intermediate_size=hf["intermediate_size"],
                              layers=tuple(range(hf["num_hidden_layers"])),
                              norm_topk_prob=bool(hf.get("norm_topk_prob", False))))


class OlmoeForCausalLM(DecoderLM):
    pass


FAMILIES = [Family("olmoe", ("OlmoeForCausalLM",), OlmoeForCausalLM, config,
                   examples="OLMoE-1B-7B", moe=True,
                   attention="GQA, q/k RMSNorm across heads, `clip_qkv`, q/k/v/o bias",
                   feed_forward="MoE: softmax top-k (`norm_topk_prob`)", quantization=MOE_QUANT)]
