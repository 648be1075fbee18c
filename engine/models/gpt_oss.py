"""gpt-oss: sliding (128) and full attention layers alternating, every layer with a learned sink
logit per head and q/k/v/o biases, YaRN rotary; every feed-forward an MoE whose router has a
bias (softmax over the top-k logits: the renormalized top-k of the softmax) and whose experts
have biases and a clamped SwiGLU ((up + 1) * gate * sigmoid(1.702 * gate), both clamped to 7).
The experts are stored fused, [E, H, 2I] with gate and up columns alternating; every MoE
backend takes their biases and activation (on CUDA the fused Triton kernel, in CUDA graphs).
MXFP4 checkpoints (the published ones) are refused by name: dequantize them to bf16 first."""

from __future__ import annotations

from engine.config import MoEConfig, sliding_config
from engine.layers.decoder import DecoderLM
from engine.models import MOE_QUANT, Family


def config(hf: dict) -> dict:
    quant = hf.get("quantization_config") or {}
    if quant:
        raise ValueError(f"gpt-oss checkpoints quantized as {quant.get('quant_method', quant)!r} "
                         "are not supported: dequantize the experts to bf16 first (transformers "
                         "loads them dequantized with Mxfp4Config(dequantize=True))")
    n = hf["num_hidden_layers"]
    return dict(attention_bias=True, o_proj_bias=True,
                moe=MoEConfig(num_experts=hf["num_local_experts"],
                              top_k=hf["num_experts_per_tok"],
                              intermediate_size=hf["intermediate_size"], layers=tuple(range(n)),
                              norm_topk_prob=True, router_bias=True, expert_bias=True,
                              activation="swiglu_limit",
                              swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                              swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                              fused_layout="transposed_interleaved"),
                **sliding_config(hf, sinks=True))


class GptOssForCausalLM(DecoderLM):
    RENAMES = {".mlp.router.": ".mlp.gate.", ".self_attn.sinks": ".self_attn.attn.sinks"}


FAMILIES = [Family("gpt_oss", ("GptOssForCausalLM",), GptOssForCausalLM, config,
                   examples="gpt-oss-20b, gpt-oss-120b (dequantized to bf16)", moe=True,
                   attention="GQA, q/k/v/o bias; sliding (128) and full layers alternating, "
                             "a sink logit per head",
                   feed_forward="MoE: router with bias, experts with biases, clamped SwiGLU",
                   quantization=MOE_QUANT)]
