"""The attention layer: stores a step's K/V and attends, through the engine's backend."""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.base import AttentionBackend


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.backend = backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], cache: torch.Tensor, meta
                ) -> torch.Tensor:
        """q [T, H, D], k, v [T, KVH, D]; cache [2, N, block_size, KVH, D] -> [T, H * D]."""
        out = self.backend.forward(q, k, v, rope, cache, meta, self.scale)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
