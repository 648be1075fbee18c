"""Gemma 2 and Gemma 3 (text): sliding layers between global ones, and the Gemma decoder layer.

- Layers: Gemma 2 alternates sliding and global attention; Gemma 3 runs five sliding layers to
  one global (`layer_types`, or the older `sliding_window_pattern`), its sliding layers with a
  rotary base of their own (`rope_local_base_freq`, or `rope_parameters.sliding_attention`)
  and its global ones with the model's base and scaling.
- Attention: scores scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5; Gemma 2
  soft-caps them (`attn_logit_softcapping`) and the logits (`final_logit_softcapping`); Gemma 3
  RMS-norms q and k per head.
- Norms: x * (1 + w), computed in fp32 and rounded once; four per layer (before and after the
  attention, before and after the MLP: the stream adds each sub-layer's post-normed output).
- MLP: GeGLU with the tanh GELU. Embeddings scaled by sqrt(hidden_size) (in the model's dtype);
  the head tied to them.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig, rope_scaling_of, sliding_config
from engine.layers import LayerOptions
from engine.layers.decoder import DecoderLM, GQAAttention
from engine.layers.norm import RMSNorm
from engine.models import Family


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w), in fp32, rounded to x's dtype once (the torch path only: the fused
    kernels apply w, not 1 + w)."""

    def __init__(self, dim: int, eps: float, kernels: str = "torch") -> None:
        super().__init__(dim, eps, "torch")
        self.weight.data.zero_()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GemmaDecoderLayer(nn.Module):
    """Pre- and post-norms around the attention and around the MLP."""

    def __init__(self, cfg: ModelConfig, opts: LayerOptions, mlp: nn.Module, layer: int = 0
                 ) -> None:
        super().__init__()
        self.self_attn = GQAAttention(cfg, opts, layer, norm_cls=GemmaRMSNorm)
        self.mlp = mlp
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x, residual, rope, cache, meta):
        """As DecoderLayer: the stream is x + residual (x at layer 0); returns this layer's MLP
        output and the stream before it."""
        stream = x if residual is None else x + residual
        a = self.self_attn(self.input_layernorm(stream), rope, cache, meta)
        stream = stream + self.post_attention_layernorm(a)
        m = self.mlp(self.pre_feedforward_layernorm(stream))
        return self.post_feedforward_layernorm(m), stream


class GemmaForCausalLM(DecoderLM):
    LAYER = GemmaDecoderLayer
    NORM = GemmaRMSNorm

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        return x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)


def _softcap(hf: dict, key: str) -> float:
    return float(hf.get(key) or 0.0)


def gemma2_config(hf: dict) -> dict:
    return dict(query_scale=float(hf["query_pre_attn_scalar"]) ** -0.5,
                final_logit_softcap=_softcap(hf, "final_logit_softcapping"),
                **sliding_config(hf, softcap=_softcap(hf, "attn_logit_softcapping")))


def gemma3_config(hf: dict) -> dict:
    rope = hf.get("rope_parameters") or {}
    if "sliding_attention" in rope:
        local = dict(rope["sliding_attention"])
        local_theta = float(local.pop("rope_theta", 10000.0))
    else:
        local, local_theta = {}, float(hf.get("rope_local_base_freq") or 10000.0)
    glob = rope.get("full_attention") or {}
    theta = float(glob.get("rope_theta", hf.get("rope_theta", 1_000_000.0)))
    return dict(query_scale=float(hf["query_pre_attn_scalar"]) ** -0.5, qk_norm=True,
                rope_theta=theta,
                final_logit_softcap=_softcap(hf, "final_logit_softcapping"),
                **sliding_config(hf, softcap=_softcap(hf, "attn_logit_softcapping"),
                                 local_rope=(local_theta, rope_scaling_of(local))))


FAMILIES = [
    Family("gemma2", ("Gemma2ForCausalLM",), GemmaForCausalLM, gemma2_config,
           examples="Gemma 2 2B, 9B, 27B",
           attention="GQA; sliding and global layers alternating, soft-capped scores",
           feed_forward="dense GeGLU (tanh)"),
    Family("gemma3_text", ("Gemma3ForCausalLM",), GemmaForCausalLM, gemma3_config,
           examples="Gemma 3 1B (text)",
           attention="GQA, q/k RMSNorm; five sliding layers to one global, local rotary base",
           feed_forward="dense GeGLU (tanh)"),
]
