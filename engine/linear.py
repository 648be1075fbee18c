"""CPU fast paths for the model's linear layers: weights packed once, at load time.

Two backends, picked per host by `prepack_linears(model)`:
- `Avx2Linear` (kernels/cpu_linear.py, our kernel) on x86 CPUs whose best vector ISA is AVX2:
  at memory speed up to ~9 rows and near the FMA peak beyond, where oneDNN reaches 60-80% of
  the peak (`pdserve linearbench`, the default model, one thread: 1 row 33 vs 36 ms, 9 rows 34
  vs 64 ms). A row's result does not depend on the rest of the batch.
- `OneDnnLinear` elsewhere on fp32 CPUs with torch's oneDNN ops (AVX-512, AMX): MKL's sgemm
  spends much of a small-batch step repacking each weight; oneDNN with the weight packed once is
  10-25% faster at 10-32 rows on AVX2 (and uses the wider units where they exist).
GPUs, other dtypes and builds without either keep nn.Linear.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kernels import cpu_linear

log = logging.getLogger(__name__)

PACK_ROWS_HINT = 16   # the batch size oneDNN tunes the packed layout for


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))


class Avx2Linear(nn.Module):
    """y = x @ W.T + b with W packed in 16-feature panels for kernels/cpu_linear.py."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", cpu_linear.pack(linear.weight), persistent=False)
        self.register_buffer("bias", cpu_linear.pad_bias(linear.bias), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_linear.linear(x, self.packed, self.out_features, self.bias)


class OneDnnLinear(nn.Module):
    """y = x @ W.T + b with W held in oneDNN's packed layout (read-only after packing)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT),
                             persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def packed_linear_class(device: torch.device, dtype: torch.dtype) -> type[nn.Module] | None:
    """The packed linear this host runs best, or None to keep nn.Linear."""
    if device.type != "cpu" or dtype != torch.float32:
        return None
    if cpu_linear.available():
        return Avx2Linear
    return OneDnnLinear if onednn_available(device, dtype) else None


def prepack_linears(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Replace the model's nn.Linear modules by this host's packed linear in place; returns how
    many.

    A linear whose weight is shared (a tied lm_head) gets its own packed copy; the shared
    parameter stays where it is for its other user.
    """
    cls = packed_linear_class(device, dtype)
    if cls is None:
        return 0
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in swaps:
        setattr(parent, name, cls(child))
    log.info("packed %d linear layers (%s)", len(swaps), cls.__name__)
    return len(swaps)
