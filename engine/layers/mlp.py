"""The dense feed-forward: a gated MLP (SwiGLU, or GeGLU with the tanh GELU)."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers import LayerOptions
from engine.layers.activation import GeluTanhAndMul, SiluAndMul
from engine.layers.linear import MergedLinear, RowParallelLinear
from engine.parallel import TPGroup


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up one merged matmul; column/row parallel."""

    def __init__(self, hidden: int, intermediate: int, opts: LayerOptions,
                 tp: TPGroup | None = None, reduce: bool = True, act: str = "silu") -> None:
        super().__init__()
        tp = opts.tp if tp is None else tp
        self.gate_up_proj = MergedLinear(hidden, [intermediate, intermediate], False, opts.linear,
                                         tp)
        self.act = SiluAndMul(opts.kernels) if act == "silu" else GeluTanhAndMul()
        self.down_proj = RowParallelLinear(intermediate, hidden, False, opts.linear, tp,
                                           reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))           # [T, hidden]
