"""RMSNorm, optionally fused with the residual add before it.

`forward(x)` -> normed x; `forward(x, residual)` -> (normed (x + residual), x + residual): the
decoder layers pass the running residual through every norm, so the add and the norm are one
kernel on GPUs (pdkernels/triton_norm.py), and one pass over the rows on x86 CPUs with the
torch attention backend's CPU kernels (kernels "cpu": pdkernels/cpu_ops.py, fp32). The torch path
is HF's arithmetic, op for op (fp32 exact parity): the sum in the model dtype, the norm in fp32,
the weight applied in the dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from pdkernels import cpu_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: str = "torch") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.kernels = kernels
        self._triton = None
        if kernels == "triton":
            from pdkernels.triton_norm import rms_norm
            self._triton = rms_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self._triton is not None:
            return self._triton(x, self.weight, self.eps, residual)
        if self.kernels == "cpu" and self._cpu_ok(x, residual):
            return cpu_ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _cpu_ok(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        w = self.weight
        return (w.dtype == torch.float32 and w.is_contiguous() and cpu_ops.supports(x)
                and (residual is None or (residual.shape == x.shape
                                          and cpu_ops.supports(residual))))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
