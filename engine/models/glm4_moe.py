"""GLM-4.5 / 4.6 / 4.7 (`glm4_moe`): GQA attention with q/k/v biases, optional per-head q/k
RMSNorm (`use_qk_norm`) and partial rotary (`partial_rotary_factor`); the first
`first_k_dense_replace` layers dense, the rest MoE with the DeepSeek-style router (sigmoid,
`e_score_correction_bias`, group-limited top-k, `routed_scaling_factor`) plus
`n_shared_experts` shared experts as one MLP. The checkpoints' next-token-prediction layer
(layer index num_hidden_layers) is not used."""

from __future__ import annotations

from engine.config import MoEConfig
from engine.layers.decoder import DecoderLM
from engine.models import MOE_QUANT, Family


def config(hf: dict) -> dict:
    first_moe = hf.get("first_k_dense_replace", 0)
    return dict(qk_norm=bool(hf.get("use_qk_norm", False)),
                moe=MoEConfig(num_experts=hf["n_routed_experts"],
                              top_k=hf["num_experts_per_tok"],
                              intermediate_size=hf["moe_intermediate_size"],
                              layers=tuple(range(first_moe, hf["num_hidden_layers"])),
                              scoring="sigmoid", correction_bias=True,
                              norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                              n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
                              routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                              shared_intermediate_size=(hf.get("n_shared_experts") or 0)
                              * hf["moe_intermediate_size"]))


class Glm4MoeForCausalLM(DecoderLM):
    RENAMES = {".mlp.shared_experts.": ".mlp.shared_expert."}
    EXTRA_LAYERS = True


FAMILIES = [Family("glm4_moe", ("Glm4MoeForCausalLM",), Glm4MoeForCausalLM, config,
                   examples="GLM-4.5, GLM-4.5-Air, GLM-4.6, GLM-4.7 (bf16; the FP8 releases are refused)", moe=True,
                   attention="GQA, q/k/v bias, q/k RMSNorm per head (`use_qk_norm`), partial "
                             "rotary",
                   feed_forward="MoE: sigmoid router, correction bias, group-limited top-k, "
                                "`routed_scaling_factor`; shared experts; the first "
                                "`first_k_dense_replace` layers dense",
                   quantization=MOE_QUANT)]
