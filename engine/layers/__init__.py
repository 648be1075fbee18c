"""Reusable model layers: linear layers with their weight loaders and methods, RMSNorm (fused
with the residual add), SiLU-and-mul, rotary embeddings, and the attention layer over the
engine's attention backend. Models (engine.models) are plain compositions of these."""

from __future__ import annotations

from dataclasses import dataclass

from engine.attention.base import AttentionBackend
from engine.layers.linear import LinearMethod
from engine.parallel import SINGLE, TPGroup


@dataclass(frozen=True)
class LayerOptions:
    """What a model's layers are built with."""

    attention: AttentionBackend     # also decides the norms' and activation's kernels
    linear: LinearMethod
    tp: TPGroup = SINGLE            # this rank's tensor-parallel group (engine.parallel)
    head: LinearMethod | None = None   # lm_head's, when not `linear` (quantized models: dense)
    expert_parallel: bool = False   # MoE experts split whole over the ranks (engine.layers.moe)
    moe_backend: str = "auto"       # engine.layers.moe.MOE_BACKENDS

    @property
    def head_linear(self) -> LinearMethod:
        return self.head or self.linear

    @property
    def kernels(self) -> str:
        return self.attention.kernels
