"""Model families. Each family maps an HF config to our own torch modules."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM

# family -> model class; Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm) are Llama variants whose
# differences are flags of ModelConfig, handled inside llama.py.
MODEL_CLASSES = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}


def model_class(family: str):
    try:
        return MODEL_CLASSES[family]
    except KeyError:
        raise ValueError(f"no model code for family {family!r}; known: {sorted(MODEL_CLASSES)}")
