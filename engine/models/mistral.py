"""Mistral: Llama's layers, every layer sliding when the config sets `sliding_window`
(Mistral 7B v0.1: 4,096; later versions null: full attention)."""

from __future__ import annotations

from engine.config import sliding_config
from engine.models import Family
from engine.models.llama import LlamaForCausalLM

FAMILIES = [
    Family("mistral", ("MistralForCausalLM",), LlamaForCausalLM, sliding_config,
           examples="Mistral 7B, Mistral NeMo, Ministral",
           attention="GQA; sliding window where the config sets one"),
]
