"""Linear layers that own how their weight is loaded and how they compute.

A `Linear` holds weight [out_features, in_features] (and bias) as parameters; its
`weight_loader(param, loaded, shard)` is what the model loader (engine.weights) calls for every
checkpoint tensor that lands in one of them. `MergedLinear` is one matmul over several checkpoint
projections stacked on the output dimension (q/k/v -> qkv_proj, gate/up -> gate_up_proj): shard
i fills its own row range. Under tensor parallelism (engine.parallel) `MergedLinear` is
column-parallel (each projection split on its own), `ColumnParallelLinear` splits the output
(lm_head over the vocabulary) and `RowParallelLinear` the input, with an all-reduce; each loader
reads only its rank's slice of the checkpoint tensor. Nothing is swapped after loading.

How a layer computes is its LinearMethod, chosen when the model is built (`linear_method_for`).
The method creates the layer's weight parameters (`create_weights`: a float `weight`, or a
pre-quantized checkpoint's int8 `weight` and float32 `weight_scale`, which the same loaders
shard), and `process_weights_after_loading` lets it repack them once:
- `DenseMethod`: F.linear (GPUs, 16-bit dtypes, hosts without a faster kernel).
- `Avx2Method` (pdkernels/cpu_linear.py, ours) by default on x86 CPUs whose best vector ISA is
  AVX2 (it runs on AVX-512 ones too): at memory speed up to ~9 rows and near the FMA peak
  beyond, where oneDNN reaches 60-80% of the peak (`pdserve linearbench`). A row's result does
  not depend on the rest of the batch.
- `Avx512Method`: the same kernel and panels built for AVX-512F (the same bits), by default on
  Intel AVX-512 hosts, whose two 512-bit FMA units it keeps busy.
- `AmxMethod`: fp32 layers on the AMX tile unit of Intel CPUs (Sapphire Rapids and later), by
  default there: each value split into two bf16 pieces, each term three tile products (hi*hi +
  hi*lo + lo*hi) summed in fp32, within ~2^-16 of the term; 1.5-2.3x the AVX-512 build from 16
  rows up (`pdserve linearbench`). A row's result does not depend on the batch either.
- `OneDnnMethod` by default on other fp32 CPUs with torch's oneDNN ops (AVX-512, AMX): the
  weight packed once in oneDNN's layout instead of MKL repacking it on every small-batch call.
`--linear-method` forces one of them where it can run (`linear_method_for`).
- `Int8Method` (--quantization int8): weight-only int8 per output channel, quantized at load.
- `QuantizedMethod`: a pre-quantized checkpoint's integer weights with group or channel scales
  (GPTQ, AWQ, compressed-tensors W4A16 / W8A8; engine.layers.quant_formats), activations
  quantized per token for W8A8.
The packed methods drop the plain weight after packing (a tied one stays with its other user).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import LINEAR_METHODS
from engine.layers.quant_formats import QuantScheme
from engine.parallel import SINGLE, TPGroup
from pdkernels import cpu_linear

log = logging.getLogger(__name__)

PACK_ROWS_HINT = 16   # the batch size oneDNN tunes the packed layout for


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))


class LinearMethod:
    """How a Linear computes y = x @ W.T + b. Stateless: what it prepares lives on the layer."""

    name = "dense"

    def create_weights(self, layer: "Linear") -> None:
        """The layer's weight parameters (the bias is the layer's own)."""
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features),
                                    requires_grad=False)

    def process_weights_after_loading(self, layer: "Linear") -> None:
        pass

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


DenseMethod = LinearMethod


def _drop_weight(layer: "Linear") -> None:
    del layer.weight
    layer.weight = None


class Avx2Method(LinearMethod):
    """W packed in 16-feature panels for pdkernels/cpu_linear.py."""

    name = "avx2"

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return cpu_linear.pack(weight)

    def process_weights_after_loading(self, layer: "Linear") -> None:
        layer.register_buffer("packed", self.pack(layer.weight), persistent=False)
        layer.register_buffer("packed_bias", cpu_linear.pad_bias(layer.bias), persistent=False)
        _drop_weight(layer)

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        return cpu_linear.linear(x, layer.packed, layer.out_features, layer.packed_bias,
                                 isa=self.name)


class Avx512Method(Avx2Method):
    """The same panels, computed by the kernel's AVX-512 build (two panels per pass of up to 12
    rows): the same bits as Avx2Method, faster where 512-bit FMAs run at full width."""

    name = "avx512"


class AmxMethod(Avx2Method):
    """W packed as bf16 hi and lo tiles for the AMX kernel of pdkernels/cpu_linear.py: fp32
    layers as three bf16 tile products per term (hi*hi + hi*lo + lo*hi, fp32 sums), on Intel
    AMX hosts. A row's result does not depend on its batch."""

    name = "amx"

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return cpu_linear.pack_amx(weight)

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        return cpu_linear.linear_amx(x, layer.packed, layer.out_features, layer.packed_bias)


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


class IntegerWeights(LinearMethod):
    """Integer weights q [N, K] (int8 storage) with float32 scales [N, groups] (one group: per
    output channel): W[n, k] = q[n, k] * scale[n, k // (K / groups)]. On AVX2 fp32 CPUs the
    int8 panels of pdkernels/cpu_linear.py (a quarter of fp32's bytes to stream: faster where
    decode is memory-bound); on CUDA the Triton kernel of pdkernels/triton_quant_linear.py (8-bit
    weights as int8, 4-bit ones packed two per byte, unpacked and widened in registers; split
    over K at decode so the grid fills the GPU); elsewhere the torch reference, dequantize-then-matmul (correct,
    not fast). With `act_bits` 8 (W8A8), each row of x is first quantized to int8 with its own
    scale (dynamic, per token), as the checkpoint was calibrated."""

    act_bits = 16

    def __init__(self, kernel: bool) -> None:
        self.kernel = kernel

    def _prepare(self, layer: "Linear", q: torch.Tensor, scale: torch.Tensor) -> None:
        """Hold q [N, K] int8 and scale [N, groups] float32 in this method's layout."""
        layer.groups = scale.shape[1]
        layer.group = layer.in_features // layer.groups
        if self.kernel:
            layer.register_buffer("packed", cpu_linear.pack_int8(q.cpu()), persistent=False)
            layer.register_buffer("packed_bias", cpu_linear.pad_bias(layer.bias),
                                  persistent=False)
            packed_scale = (cpu_linear.pad_bias(scale[:, 0].contiguous()) if layer.groups == 1
                            else cpu_linear.pack_group_scales(scale))
            layer.register_buffer("scale", packed_scale, persistent=False)
        elif q.is_cuda:        # 4-bit schemes packed two weights per byte for the Triton kernel
            from pdkernels import triton_quant_linear as tq
            bits = getattr(getattr(self, "scheme", None), "bits", 8)
            qweight, scale, offset, layer.qbits = tq.prepare(q, scale, bits)
            layer.register_buffer("qweight", qweight, persistent=False)
            layer.register_buffer("qoffset", offset, persistent=False)
            layer.register_buffer("scale", scale, persistent=False)
        else:
            layer.register_buffer("qweight", q.contiguous(), persistent=False)
            layer.register_buffer("scale", scale.float().contiguous(), persistent=False)

    def _matmul(self, layer: "Linear", x: torch.Tensor, bias: torch.Tensor | None
                ) -> torch.Tensor:
        if self.kernel:
            if layer.groups == 1:
                return cpu_linear.linear_int8(x, layer.packed, layer.scale, layer.out_features,
                                              bias)
            return cpu_linear.linear_int8_grouped(x, layer.packed, layer.scale, layer.group,
                                                  layer.out_features, bias)
        if x.is_cuda:
            from pdkernels.triton_quant_linear import quant_linear
            return quant_linear(x, layer.qweight, layer.scale, bias,
                                getattr(layer, "qoffset", None), getattr(layer, "qbits", 8))
        w = layer.qweight.to(x.dtype) * layer.scale.to(x.dtype).repeat_interleave(layer.group, 1)
        return F.linear(x, w, bias)

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        bias = layer.packed_bias if self.kernel else layer.bias
        if self.act_bits == 16:
            return self._matmul(layer, x, bias)
        xq, xs = quantize_per_token(x)
        y = self._matmul(layer, xq, None)
        y = y.mul_(xs) if y.dtype == torch.float32 else (y.float() * xs).to(x.dtype)
        return y if layer.bias is None else y.add_(layer.bias.to(y.dtype))


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 per row: x ~= xq * scale, xq integers in [-127, 127] held in x's
    dtype (exact in fp32, fp16 and bf16), scale [..., 1] float32."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).div_(127.0).clamp_min_(1e-12)
    return torch.div(xf, scale).round_().clamp_(-127, 127).to(x.dtype), scale


class Int8Method(IntegerWeights):
    """--quantization int8: weight-only int8, per output channel, symmetric, quantized at load
    from any checkpoint's float weight (W ~= q * scale)."""

    name = "int8"

    def process_weights_after_loading(self, layer: "Linear") -> None:
        q, scale = cpu_linear.quantize_int8(layer.weight)
        device = layer.weight.device
        _drop_weight(layer)
        self._prepare(layer, q.to(device), scale.to(device)[:, None])


class QuantizedMethod(IntegerWeights):
    """A pre-quantized checkpoint's linear layers (`scheme`: GPTQ, AWQ, compressed-tensors):
    parameters `weight` int8 [N, K] (the stored value minus its zero point) and `weight_scale`
    float32 [N, K / group] ([N, 1] per channel), filled by the layers' own loaders from the
    tensors engine.layers.quant_formats converts."""

    def __init__(self, scheme: QuantScheme, kernel: bool) -> None:
        super().__init__(kernel)
        self.scheme = scheme
        self.name = scheme.name
        self.act_bits = scheme.act_bits

    def create_weights(self, layer: "Linear") -> None:
        k, group = layer.in_features, self.scheme.group
        if group and k % group:
            raise ValueError(f"{k} input features (per tensor-parallel rank) are not whole "
                             f"groups of {group}: this checkpoint cannot be split so")
        groups = k // group if group else 1
        layer.weight = nn.Parameter(torch.empty(layer.out_features, k, dtype=torch.int8),
                                    requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.empty(layer.out_features, groups),
                                          requires_grad=False)
        layer.float32_params = ("weight_scale",)      # not rounded to the model's dtype
        layer.qmax = (1 << (self.scheme.bits - 1)) - 1     # random weights' range

    def process_weights_after_loading(self, layer: "Linear") -> None:
        q, scale = layer.weight.data, layer.weight_scale.data
        del layer.weight_scale
        _drop_weight(layer)
        self._prepare(layer, q, scale)


QUANTIZATIONS = ("none", "int8")


def _refuse(choice: str, why: str) -> ValueError:
    return ValueError(f"--linear-method {choice}: {why}")


def linear_method_for(device: torch.device, dtype: torch.dtype,
                      quantization: str | QuantScheme = "none", choice: str = "auto"
                      ) -> LinearMethod:
    """How the linear layers of weights of `dtype` on `device` compute, quantized as
    `quantization` says ("none", "int8", or a pre-quantized checkpoint's scheme).

    `choice` ("auto", or one of LINEAR_METHODS) forces a CPU path: "avx2" our kernel (any x86
    CPU with AVX2 and FMA, AVX-512 ones too; integer weights in its int8 panels), "avx512" its
    AVX-512 build (float weights: the same bits; integer ones keep the AVX2 panels), "amx" the
    AMX kernel (float weights on Intel AMX CPUs: three bf16 products per term), "onednn"
    torch's oneDNN packed linear (float weights only: integer weights are refused), "torch"
    F.linear (integer weights: the dequantize-then-matmul reference, or the Triton kernel on
    CUDA). "auto" is what measured fastest on the host's kind (README, `pdserve stepbench`):
    the AMX kernel on Intel AMX hosts, our kernel where the best ISA is AVX2 and on AMD Zen 4
    (AVX-512 on 256-bit units), its AVX-512 build on other Intel AVX-512 hosts, oneDNN on other
    AVX-512 hosts for float weights (our kernel for integer ones), F.linear elsewhere. A forced
    path that cannot run here is an error naming why."""
    if choice not in LINEAR_METHODS:
        raise ValueError(f"linear method must be one of {LINEAR_METHODS}, got {choice!r}")
    quantized = isinstance(quantization, QuantScheme) or quantization == "int8"
    if not isinstance(quantization, QuantScheme) and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    fp32_cpu = device.type == "cpu" and dtype == torch.float32
    if choice in ("avx2", "avx512", "amx", "onednn") and not fp32_cpu:
        raise _refuse(choice, f"a float32 CPU path (this engine computes {dtype} on "
                              f"{device.type}); use auto or torch")
    if choice == "avx2" and not cpu_linear.available():
        raise _refuse(choice, "our kernel needs an x86 CPU with AVX2 and FMA and a C++ "
                              "compiler (see the log for why it did not build)")
    if choice == "avx512" and not cpu_linear.available_avx512():
        raise _refuse(choice, "our AVX-512 kernel needs an x86 CPU with AVX-512F and a C++ "
                              "compiler (see the log for why it did not build)")
    if choice == "amx":
        if quantized:
            raise _refuse(choice, "the AMX kernel takes float weights only; integer weights "
                                  "(--quantization, a pre-quantized checkpoint) run with "
                                  "--linear-method avx2, torch or auto")
        if not cpu_linear.available_amx():
            raise _refuse(choice, "the AMX kernel needs an Intel CPU with AMX-BF16 (Sapphire "
                                  "Rapids or later), Linux 5.16+ and a C++ compiler (see the "
                                  "log for why it did not load)")
    if choice == "onednn":
        if quantized:
            raise _refuse(choice, "oneDNN's packed linear takes float weights only; integer "
                                  "weights (--quantization, a pre-quantized checkpoint) run "
                                  "with --linear-method avx2, torch or auto")
        if not onednn_available(device, dtype):
            raise _refuse(choice, "this torch build has no oneDNN linear ops")
    kernel = fp32_cpu and cpu_linear.available() and choice in ("auto", "avx2", "avx512")
    if isinstance(quantization, QuantScheme):
        return QuantizedMethod(quantization, kernel)
    if quantization == "int8":
        return Int8Method(kernel)
    if choice == "amx" or (choice == "auto" and kernel and cpu_linear.preferred_amx()):
        return AmxMethod()
    if choice == "avx512" or (choice == "auto" and kernel and cpu_linear.preferred_avx512()):
        return Avx512Method()
    if choice == "avx2" or (choice == "auto" and kernel and cpu_linear.preferred()):
        return Avx2Method()
    if choice == "onednn" or (choice == "auto" and onednn_available(device, dtype)):
        return OneDnnMethod()
    return DenseMethod()


def runnable_linear_methods(device: torch.device, dtype: torch.dtype,
                            quantization: str | QuantScheme = "none") -> list[str]:
    """The forced choices that run on this host for these weights (tests and benchmarks go
    over every one)."""
    ok = []
    for choice in LINEAR_METHODS[1:]:
        try:
            linear_method_for(device, dtype, quantization, choice)
        except ValueError:
            continue
        ok.append(choice)
    return ok


def materialize(loaded) -> torch.Tensor:
    """A loader's argument as a tensor: a tensor, or a checkpoint tensor read now in full
    (engine.weights.CheckpointTensor: read lazily, so a rank reads only its slice)."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded.load()


def _check_shape(loaded, want: tuple, what: str = "") -> None:
    if tuple(loaded.shape) != tuple(want):
        raise ValueError(f"{what}checkpoint gives {tuple(loaded.shape)}, model expects "
                         f"{tuple(want)}")


def _copy_loader(param: nn.Parameter, loaded, shard: int | None = None) -> None:
    if shard is not None:
        raise ValueError(f"a parameter of shape {tuple(param.shape)} takes no shards")
    _check_shape(loaded, param.shape)
    param.data.copy_(materialize(loaded))


def _rows(loaded, start: int, n: int, dim: int = 0) -> torch.Tensor:
    """Rows [start, start + n) of `loaded` along `dim`; rows past its end are zeros (a padded
    vocabulary partition)."""
    have = max(0, min(n, loaded.shape[dim] - start))
    part = loaded.narrow(dim, start, have) if have else None
    if have == n:
        return part
    shape = list(loaded.shape)
    shape[dim] = n
    out = torch.zeros(shape, dtype=part.dtype if part is not None else torch.float32)
    if part is not None:
        out.narrow(dim, 0, have).copy_(part)
    return out


class Linear(nn.Module):
    """y = x @ W.T (+ b), computed by `method`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 method: LinearMethod | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.method = method or DenseMethod()
        self.method.create_weights(self)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded, shard: int | None = None) -> None:
        _copy_loader(param, loaded, shard)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
                f"method={self.method.name}")


def _even(size: int, tp: TPGroup, what: str) -> int:
    if size % tp.size:
        raise ValueError(f"{what} {size} does not split over {tp.size} tensor-parallel ranks")
    return size // tp.size


class MergedLinear(Linear):
    """One matmul over projections stacked on the output dim (q/k/v -> qkv_proj, gate/up ->
    gate_up_proj). Column-parallel under tensor parallelism: each checkpoint projection is split
    on its own, shard i taking its rows `splits[i]` = (start, count) of the checkpoint tensor
    (default: an even split by rank), stacked as rows [offsets[i], offsets[i] + count) here."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 method: LinearMethod | None = None, tp: TPGroup = SINGLE,
                 splits: list[tuple[int, int]] | None = None) -> None:
        if splits is None:
            splits = [(tp.rank * n, n) for n in
                      (_even(s, tp, "output size") for s in output_sizes)]
        local = [n for _, n in splits]
        super().__init__(in_features, sum(local), bias, method)
        self.tp = tp
        self.full_sizes = list(output_sizes)
        self.splits = list(splits)
        self.output_sizes = local
        self.offsets = [sum(local[:i]) for i in range(len(local))]

    def weight_loader(self, param: nn.Parameter, loaded, shard: int | None = None) -> None:
        if shard is None:                       # a checkpoint that stores the merged tensor
            if self.tp.size == 1:
                _copy_loader(param, loaded)
                return
            _check_shape(loaded, (sum(self.full_sizes), *param.shape[1:]), "merged: ")
            start = 0                           # each projection's rows, then this rank's share
            for i, size in enumerate(self.full_sizes):
                self.weight_loader(param, loaded.narrow(0, start, size), i)
                start += size
            return
        if not 0 <= shard < len(self.output_sizes):
            raise ValueError(f"shard {shard} of a layer merging {len(self.output_sizes)}")
        _check_shape(loaded, (self.full_sizes[shard], *param.shape[1:]), f"shard {shard}: ")
        (start, n), off = self.splits[shard], self.offsets[shard]
        param.data[off:off + n].copy_(loaded.narrow(0, start, n))

    def shard_rows(self, shard: int) -> tuple[int, int]:
        """Rows of the merged weight that `shard` fills."""
        return self.offsets[shard], self.offsets[shard] + self.output_sizes[shard]


class ColumnParallelLinear(Linear):
    """Output features split over the ranks, ceil(out / N) each (the last partition padded with
    zero rows: a vocabulary that does not divide); `gather` concatenates every rank's outputs
    and drops the padding."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 method: LinearMethod | None = None, tp: TPGroup = SINGLE) -> None:
        per = -(-out_features // tp.size)
        super().__init__(in_features, per, bias, method)
        self.tp, self.full_out, self.start = tp, out_features, tp.rank * per

    def weight_loader(self, param: nn.Parameter, loaded, shard: int | None = None) -> None:
        if shard is not None:
            raise ValueError(f"a parameter of shape {tuple(param.shape)} takes no shards")
        _check_shape(loaded, (self.full_out, *param.shape[1:]))
        param.data.copy_(_rows(loaded, self.start, param.shape[0]))

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(y, dim=-1)[..., :self.full_out]


class RowParallelLinear(Linear):
    """Input features split over the ranks, the partial products summed by an all-reduce. The
    bias is rank 0's alone (the others hold zeros), so it is added once. `reduce` False: the
    caller sums the partial products (an MoE layer adds its shared experts' before its one
    all-reduce)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 method: LinearMethod | None = None, tp: TPGroup = SINGLE,
                 reduce: bool = True) -> None:
        super().__init__(_even(in_features, tp, "input size"), out_features, bias, method)
        self.tp, self.full_in, self.reduce = tp, in_features, reduce

    def weight_loader(self, param: nn.Parameter, loaded, shard: int | None = None) -> None:
        if shard is not None:
            raise ValueError(f"a parameter of shape {tuple(param.shape)} takes no shards")
        if param.dim() == 1:                     # the bias
            _check_shape(loaded, param.shape)
            if self.tp.leader:
                param.data.copy_(materialize(loaded))
            else:
                param.data.zero_()
            return
        if param is getattr(self, "weight_scale", None) and loaded.shape[1] == 1:
            _copy_loader(param, loaded)                 # per channel: every rank's whole
            return
        width = param.shape[1]                          # input features, or scale groups
        _check_shape(loaded, (param.shape[0], width * self.tp.size))
        param.data.copy_(loaded.narrow(1, self.tp.rank * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        return self.tp.all_reduce(y) if self.reduce else y


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
