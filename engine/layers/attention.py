"""The attention layer: stores a step's K/V and attends, through the engine's backend, with
what the layer's attention adds (engine.config.LayerAttention: a sliding window, soft-capped
scores, learned sinks)."""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.config import FULL, LayerAttention


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 backend: AttentionBackend, spec: LayerAttention = FULL, scale: float = 0.0,
                 first_head: int = 0, total_heads: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale or head_dim ** -0.5
        self.backend = backend
        self.spec = spec
        self.sinks = None
        if spec.sinks:                   # one logit per head: this rank's heads of the model's
            self.sinks = nn.Parameter(torch.zeros(num_heads), requires_grad=False)
            self._heads = (first_head, num_heads, total_heads or num_heads)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard=None) -> None:
        first, n, total = self._heads
        if tuple(loaded.shape) != (total,):
            raise ValueError(f"checkpoint gives sinks {tuple(loaded.shape)}, model expects "
                             f"({total},)")
        param.data.copy_(loaded.narrow(0, first, n))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], cache: torch.Tensor, meta
                ) -> torch.Tensor:
        """q [T, H, D], k, v [T, KVH, D]; cache [2, N, block_size, KVH, D] -> [T, H * D]."""
        out = self.backend.forward(q, k, v, rope, cache, meta, self.scale, self.spec, self.sinks)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
