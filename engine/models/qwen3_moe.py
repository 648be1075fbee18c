"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B, Qwen3-Coder): Qwen3 attention (per-head q/k RMSNorm),
MoE layers as Qwen2-MoE places them, a softmax router with `norm_topk_prob`, no shared
expert."""

from __future__ import annotations

from engine.config import MoEConfig
from engine.layers.decoder import DecoderLM
from engine.models import MOE_QUANT, Family
from engine.models.mixtral import refuse_sliding
from engine.models.qwen2_moe import num_experts, sparse_layers


def config(hf: dict) -> dict:
    refuse_sliding(hf)
    return dict(qk_norm=True,
                moe=MoEConfig(num_experts=num_experts(hf), top_k=hf["num_experts_per_tok"],
                              intermediate_size=hf["moe_intermediate_size"],
                              layers=sparse_layers(hf),
                              norm_topk_prob=bool(hf.get("norm_topk_prob", False))))


class Qwen3MoeForCausalLM(DecoderLM):
    pass


FAMILIES = [Family("qwen3_moe", ("Qwen3MoeForCausalLM",), Qwen3MoeForCausalLM, config,
                   examples="Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B", moe=True,
                   attention="GQA, q/k RMSNorm per head",
                   feed_forward="MoE: softmax top-k (`norm_topk_prob`); dense layers by "
                                "`decoder_sparse_step`, `mlp_only_layers`",
                   quantization=MOE_QUANT)]
