"""Linear layers that own how their weight is loaded and how they compute.

A `Linear` holds weight [out_features, in_features] (and bias) as parameters; its
`weight_loader(param, loaded, shard)` is what the model loader (engine.weights) calls for every
checkpoint tensor that lands in one of them. `MergedLinear` is one matmul over several checkpoint
projections stacked on the output dimension (q/k/v -> qkv_proj, gate/up -> gate_up_proj): shard
i fills its own row range. Later formats (tensor-parallel shards, quantized checkpoints) bring
their own loaders and methods; nothing is swapped after loading.

How a layer computes is its LinearMethod, chosen when the model is built (`linear_method_for`);
`process_weights_after_loading` lets the method repack the loaded weight once:
- `DenseMethod`: F.linear (GPUs, 16-bit dtypes, hosts without a faster kernel).
- `Avx2Method` (kernels/cpu_linear.py, ours) on x86 CPUs whose best vector ISA is AVX2: at memory
  speed up to ~9 rows and near the FMA peak beyond, where oneDNN reaches 60-80% of the peak
  (`pdserve linearbench`). A row's result does not depend on the rest of the batch.
- `OneDnnMethod` elsewhere on fp32 CPUs with torch's oneDNN ops (AVX-512, AMX): the weight packed
  once in oneDNN's layout instead of MKL repacking it on every small-batch call.
- `Int8Method` (--quantization int8): weight-only int8 per output channel, quantized at load.
The packed methods drop the plain weight after packing (a tied one stays with its other user).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_linear

log = logging.getLogger(__name__)

PACK_ROWS_HINT = 16   # the batch size oneDNN tunes the packed layout for


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))


class LinearMethod:
    """How a Linear computes y = x @ W.T + b. Stateless: what it prepares lives on the layer."""

    name = "dense"

    def process_weights_after_loading(self, layer: "Linear") -> None:
        pass

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


DenseMethod = LinearMethod


def _drop_weight(layer: "Linear") -> None:
    del layer.weight
    layer.weight = None


class Avx2Method(LinearMethod):
    """W packed in 16-feature panels for kernels/cpu_linear.py."""

    name = "avx2"

    def process_weights_after_loading(self, layer: "Linear") -> None:
        layer.register_buffer("packed", cpu_linear.pack(layer.weight), persistent=False)
        layer.register_buffer("packed_bias", cpu_linear.pad_bias(layer.bias), persistent=False)
        _drop_weight(layer)

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        return cpu_linear.linear(x, layer.packed, layer.out_features, layer.packed_bias)


class OneDnnMethod(LinearMethod):
    """W held in oneDNN's packed layout (read-only after packing)."""

    name = "onednn"

    def process_weights_after_loading(self, layer: "Linear") -> None:
        w = layer.weight.detach()
        layer.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT),
                              persistent=False)
        _drop_weight(layer)

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")


class Int8Method(LinearMethod):
    """Weight-only int8, per output channel, symmetric (quantized at load: any checkpoint):
    W ~= q * scale. On AVX2 fp32 CPUs the int8 panels of kernels/cpu_linear.py (a quarter of
    the bytes to stream: faster where decode is memory-bound); on CUDA the Triton kernel of
    kernels/triton_int8_linear.py (int8 tiles widened in registers); elsewhere the torch
    reference, dequantize-then-matmul (correct, not fast)."""

    name = "int8"

    def __init__(self, kernel: bool) -> None:
        self.kernel = kernel

    def process_weights_after_loading(self, layer: "Linear") -> None:
        q, scale = cpu_linear.quantize_int8(layer.weight)
        device = layer.weight.device
        if self.kernel:
            layer.register_buffer("packed", cpu_linear.pack_int8(q), persistent=False)
            layer.register_buffer("scale", cpu_linear.pad_bias(scale), persistent=False)
            layer.register_buffer("packed_bias", cpu_linear.pad_bias(layer.bias),
                                  persistent=False)
        else:
            layer.register_buffer("qweight", q.to(device), persistent=False)
            layer.register_buffer("scale", scale.to(device), persistent=False)
        _drop_weight(layer)

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            return cpu_linear.linear_int8(x, layer.packed, layer.scale, layer.out_features,
                                          layer.packed_bias)
        if x.is_cuda:
            from kernels.triton_int8_linear import int8_linear
            return int8_linear(x, layer.qweight, layer.scale, layer.bias)
        w = layer.qweight.to(x.dtype) * layer.scale.to(x.dtype)[:, None]
        return F.linear(x, w, layer.bias)


QUANTIZATIONS = ("none", "int8")


def linear_method_for(device: torch.device, dtype: torch.dtype,
                      quantization: str = "none") -> LinearMethod:
    """The method this host runs best for weights of `dtype` on `device`, quantized as
    `quantization` says ("none", "int8")."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if quantization == "int8":
        return Int8Method(kernel=device.type == "cpu" and dtype == torch.float32
                          and cpu_linear.available())
    if device.type == "cpu" and dtype == torch.float32:
        if cpu_linear.available():
            return Avx2Method()
        if onednn_available(device, dtype):
            return OneDnnMethod()
    return DenseMethod()


def _copy_loader(param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None) -> None:
    if shard is not None:
        raise ValueError(f"a parameter of shape {tuple(param.shape)} takes no shards")
    if loaded.shape != param.shape:
        raise ValueError(f"checkpoint gives {tuple(loaded.shape)}, model expects "
                         f"{tuple(param.shape)}")
    param.data.copy_(loaded)


class Linear(nn.Module):
    """y = x @ W.T (+ b), computed by `method`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 method: LinearMethod | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.method = method or DenseMethod()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard: int | None = None) -> None:
        _copy_loader(param, loaded, shard)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
                f"method={self.method.name}")


class MergedLinear(Linear):
    """One matmul over projections stacked on the output dim: shard i is rows
    [sum(output_sizes[:i]), sum(output_sizes[:i + 1]))."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 method: LinearMethod | None = None) -> None:
        super().__init__(in_features, sum(output_sizes), bias, method)
        self.output_sizes = list(output_sizes)
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard: int | None = None) -> None:
        if shard is None:                       # a checkpoint that stores the merged tensor
            _copy_loader(param, loaded)
            return
        if not 0 <= shard < len(self.output_sizes):
            raise ValueError(f"shard {shard} of a layer merging {len(self.output_sizes)}")
        size, start = self.output_sizes[shard], self.offsets[shard]
        want = (size, *param.shape[1:])
        if tuple(loaded.shape) != want:
            raise ValueError(f"shard {shard}: checkpoint gives {tuple(loaded.shape)}, model "
                             f"expects {want}")
        param.data[start:start + size].copy_(loaded)

    def shard_rows(self, shard: int) -> tuple[int, int]:
        """Rows of the merged weight that `shard` fills."""
        return self.offsets[shard], self.offsets[shard] + self.output_sizes[shard]


def packed_copy(weight: torch.Tensor, method: LinearMethod, bias: torch.Tensor | None = None
                ) -> Linear:
    """A Linear computing with `method` over a copy of `weight` [out, in] (benchmarks, tests)."""
    out_f, in_f = weight.shape
    layer = Linear(in_f, out_f, bias is not None, method)
    with torch.no_grad():
        layer.weight.data = weight.detach().clone()
        if bias is not None:
            layer.bias.data = bias.detach().clone()
    layer.process_weights_after_loading()
    return layer
