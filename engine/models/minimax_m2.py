"""MiniMax-M2 / M2.1: GQA attention with q and k each RMS-normed over all heads at once and
partial rotary (`rotary_dim`); every layer an MoE with a sigmoid router whose
`e_score_correction_bias` is added for the choice only, the chosen scores renormalized.
Checkpoints keep that bias beside the gate (`block_sparse_moe.e_score_correction_bias`) and may
carry next-token-prediction modules (unused)."""

from __future__ import annotations

from engine.config import MoEConfig
from engine.layers.decoder import DecoderLM
from engine.models import MOE_QUANT, Family


def config(hf: dict) -> dict:
    extra = {}
    if hf.get("rotary_dim") and hf["rotary_dim"] != hf.get("head_dim"):
        extra["rotary_dim"] = int(hf["rotary_dim"])
    return dict(extra, qk_norm_across_heads=bool(hf.get("use_qk_norm", True)),
                moe=MoEConfig(num_experts=hf["num_local_experts"],
                              top_k=hf["num_experts_per_tok"],
                              intermediate_size=hf["intermediate_size"],
                              layers=tuple(range(hf["num_hidden_layers"])),
                              scoring="sigmoid", correction_bias=True, norm_topk_prob=True))


class MiniMaxM2ForCausalLM(DecoderLM):
    RENAMES = {".block_sparse_moe.": ".mlp.",
               ".mlp.e_score_correction_bias": ".mlp.gate.e_score_correction_bias"}
    EXTRA_LAYERS = True


FAMILIES = [Family("minimax_m2", ("MiniMaxM2ForCausalLM",), MiniMaxM2ForCausalLM, config,
                   examples="MiniMax-M2, MiniMax-M2.1 (bf16 conversions: the FP8 releases are refused)", moe=True,
                   attention="GQA, q/k RMSNorm across heads, partial rotary (`rotary_dim`)",
                   feed_forward="MoE: sigmoid router, correction bias, top-k renormalized", quantization=MOE_QUANT)]
