"""The gated MLP's activations over the merged gate/up projection: SiLU-and-mul (SwiGLU) and
GELU(tanh)-and-mul (GeGLU, Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """[T, 2 * I] (gate, then up) -> [T, I] = silu(gate) * up."""

    def __init__(self, kernels: str = "torch") -> None:
        super().__init__()
        self._triton = None
        if kernels == "triton":
            from pdkernels.triton_activation import silu_and_mul
            self._triton = silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._triton is not None:
            return self._triton(x)
        gate, up = x.chunk(2, dim=-1)                                    # [T, I] each
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """[T, 2 * I] (gate, then up) -> [T, I] = gelu_tanh(gate) * up (HF's gelu_pytorch_tanh)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
