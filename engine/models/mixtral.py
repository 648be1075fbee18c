"""Mixtral: Llama attention, every layer an MoE of `num_local_experts` SwiGLU experts, softmax
router with the top-k weights renormalized. Checkpoints name the MoE `block_sparse_moe` and the
expert projections w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from engine.config import MoEConfig
from engine.layers.decoder import DecoderLM
from engine.models import MOE_QUANT, Family


def refuse_sliding(hf: dict) -> None:
    if hf.get("sliding_window") and hf.get("use_sliding_window", True):
        raise ValueError(f"sliding-window attention (sliding_window={hf['sliding_window']}) is "
                         "not supported yet; this checkpoint's config sets it")


def config(hf: dict) -> dict:
    refuse_sliding(hf)
    return dict(moe=MoEConfig(num_experts=hf["num_local_experts"],
                              top_k=hf["num_experts_per_tok"],
                              intermediate_size=hf["intermediate_size"],
                              layers=tuple(range(hf["num_hidden_layers"])),
                              norm_topk_prob=True))


class MixtralForCausalLM(DecoderLM):
    RENAMES = {".block_sparse_moe.": ".mlp."}


FAMILIES = [Family("mixtral", ("MixtralForCausalLM",), MixtralForCausalLM, config,
                   examples="Mixtral 8x7B, 8x22B", moe=True,
                   feed_forward="MoE: softmax top-k, renormalized", quantization=MOE_QUANT)]
