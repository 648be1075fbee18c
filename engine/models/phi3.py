"""Phi-3 and Phi-4: Llama's layers with q/k/v stored as one fused `qkv_proj` and gate/up as one
`gate_up_proj` in the checkpoint (split per projection at load, and per rank under tensor
parallelism), partial rotary where the config says (Phi-4-mini), every layer sliding when
`sliding_window` is set, LongRoPE (the 128K-context checkpoints' `longrope` scaling: short and
long factors, engine.layers.rotary)."""

from __future__ import annotations

from engine.config import sliding_config
from engine.models import Family
from engine.models.llama import LlamaForCausalLM

FAMILIES = [
    Family("phi3", ("Phi3ForCausalLM",), LlamaForCausalLM, sliding_config,
           examples="Phi-4, Phi-4-mini, Phi-3 mini / medium (4K and 128K)",
           attention="GQA, fused qkv; sliding window where the config sets one; LongRoPE"),
]
