"""Llama-family dense decoders: Llama, Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm).

The model is the shared decoder (engine.layers.decoder) with a gated MLP in every layer; the
family differences are ModelConfig flags set here.
"""

from __future__ import annotations

from engine.config import sliding_config
from engine.layers.decoder import DecoderLM
from engine.models import Family


class LlamaForCausalLM(DecoderLM):
    pass


FAMILIES = [
    Family("llama", ("LlamaForCausalLM",), LlamaForCausalLM,
           examples="Llama 3.x, SmolLM2, TinyLlama"),
    Family("qwen2", ("Qwen2ForCausalLM",), LlamaForCausalLM,
           lambda hf: dict(attention_bias=bool(hf.get("attention_bias", True)),
                           **sliding_config(hf)),
           examples="Qwen2.5", attention="GQA, q/k/v bias"),
    Family("qwen3", ("Qwen3ForCausalLM",), LlamaForCausalLM,
           lambda hf: dict(qk_norm=True, **sliding_config(hf)),
           examples="Qwen3 dense", attention="GQA, q/k RMSNorm per head"),
]
