"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention (q/k/v biases); MoE layers where
`decoder_sparse_step` and `mlp_only_layers` say, dense MLPs elsewhere; a softmax router
(`norm_topk_prob` by config) and a shared expert scaled by sigmoid(x @ shared_expert_gate)."""

from __future__ import annotations

from engine.config import MoEConfig
from engine.layers.decoder import DecoderLM
from engine.models import MOE_QUANT, Family
from engine.models.mixtral import refuse_sliding


def num_experts(hf: dict) -> int:
    """Released configs say num_experts; transformers 5 saves num_local_experts."""
    return hf.get("num_experts") or hf.get("num_local_experts") or 0


def sparse_layers(hf: dict) -> tuple[int, ...]:
    step, only = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    if not num_experts(hf):
        return ()
    return tuple(i for i in range(hf["num_hidden_layers"])
                 if i not in only and (i + 1) % step == 0)


def config(hf: dict) -> dict:
    refuse_sliding(hf)
    return dict(attention_bias=bool(hf.get("qkv_bias", True)),
                moe=MoEConfig(num_experts=num_experts(hf), top_k=hf["num_experts_per_tok"],
                              intermediate_size=hf["moe_intermediate_size"],
                              layers=sparse_layers(hf),
                              norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                              shared_intermediate_size=hf["shared_expert_intermediate_size"],
                              shared_gate=True))


class Qwen2MoeForCausalLM(DecoderLM):
    pass


FAMILIES = [Family("qwen2_moe", ("Qwen2MoeForCausalLM",), Qwen2MoeForCausalLM, config,
                   examples="Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B", moe=True,
                   attention="GQA, q/k/v bias",
                   feed_forward="MoE: softmax top-k (`norm_topk_prob`), a shared expert with a "
                                "sigmoid gate; dense layers by `decoder_sparse_step`, "
                                "`mlp_only_layers`",
                   quantization=MOE_QUANT)]
