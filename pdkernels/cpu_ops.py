"""Two of the decoder layer's small fp32 operations on x86 CPUs with AVX2 (csrc/cpu_ops.cpp):
RMSNorm with the residual add before it, and rotary embeddings in place. Each is one pass over
its rows where the torch reference (engine/layers/norm.py, rotary.py) runs several ops and
allocates their temporaries: 1.5-2.3x faster for the norm, 3.7-7x for rotary at 64-512 tokens
of the default model. (SiLU-and-mul written the same way was no faster than torch's.)

Rotary gives the reference's bits; RMSNorm sums its squares in another order, so its results
may differ from torch's in the last bits (the tests bound them). The torch attention backend
uses them with its CPU attention kernel (`--cpu-attention avx2`), where `available()`; `sdpa`
keeps the torch reference.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pdkernels import cpu_build

SOURCE = Path(__file__).with_name("csrc") / "cpu_ops.cpp"
FLAGS = [*cpu_build.AVX2_FLAGS, "-ffp-contract=off"]   # products rounded before sums, as torch


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if not cpu_build.avx2_capable():
        return None
    lib = cpu_build.load(SOURCE, FLAGS, "CPU layer ops (torch's used instead)")
    if lib is None:
        return None
    i64, ptr, f32, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    lib.pdserve_rms_norm.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64, f32,
                                     c_int]
    lib.pdserve_rotary.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, i64, c_int]
    return lib


def available() -> bool:
    return _library() is not None


def _rows_of(x: torch.Tensor) -> tuple[int, int] | None:
    """(rows, row stride) of x viewed as [rows, last dim] with unit-stride rows at a common
    stride, or None."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() == 0 or x.stride(-1) != 1:
        return None
    if x.is_contiguous():
        return x.numel() // max(x.shape[-1], 1), x.shape[-1]
    if x.dim() == 2:
        return x.shape[0], x.stride(0)
    return None


def supports(x: torch.Tensor) -> bool:
    """A float32 CPU tensor whose rows (last dim) these ops take."""
    return available() and _rows_of(x) is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """RMSNorm(x) * weight, or with `residual`: (RMSNorm(x + residual) * weight, x + residual).
    x (and residual) [..., dim] (see `supports`), weight [dim] float32 contiguous."""
    lib = _library()
    dim = x.shape[-1]
    rows, ldx = _rows_of(x)
    y = torch.empty(x.shape, dtype=torch.float32)
    if residual is None:
        lib.pdserve_rms_norm(x.data_ptr(), ldx, None, 0, y.data_ptr(), dim, None, 0,
                             weight.data_ptr(), rows, dim, eps, torch.get_num_threads())
        return y
    _, ldr = _rows_of(residual)
    out = torch.empty(x.shape, dtype=torch.float32)
    lib.pdserve_rms_norm(x.data_ptr(), ldx, residual.data_ptr(), ldr, y.data_ptr(), dim,
                         out.data_ptr(), dim, weight.data_ptr(), rows, dim, eps,
                         torch.get_num_threads())
    return y, out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (unit stride in D) rotated in place by cos, sin [T, 1, D] (or [T, D]),
    the reference's arithmetic (engine.layers.rotary.apply_rotary): the same bits. Returns x."""
    lib = _library()
    t, heads, dim = x.shape
    c = cos.reshape(t, dim).contiguous()
    s = sin.reshape(t, dim).contiguous()
    lib.pdserve_rotary(x.data_ptr(), x.stride(0), x.stride(1), t, heads, c.data_ptr(),
                       s.data_ptr(), dim, torch.get_num_threads())
    return x


def usable_rotary(x: torch.Tensor, cos: torch.Tensor) -> bool:
    return (available() and x.dtype == torch.float32 and cos.dtype == torch.float32
            and x.device.type == "cpu" and x.dim() == 3 and x.stride(2) == 1
            and x.shape[2] % 2 == 0)
