"""fp32 linear layers on x86 CPUs with AVX2: y = x @ W.T (+ b) with W packed once, at load time;
and weight-only int8 ones (`quantize_int8`, `pack_int8`, `linear_int8`): the same panels of
int8, a quarter of the memory to stream; and int8 panels with group scales (`pack_group_scales`,
`linear_int8_grouped`: pre-quantized 4- and 8-bit checkpoints, W[n, k] = q[n, k] * scale[n,
k // G]). Either way each weight is widened to fp32, in registers for one or two rows (where
decode is memory-bound), or once per call into an L1 buffer that every pass of up to 6 rows
reads (so the conversion is done once per call, not once per pass of rows); each group's sums
of x * q are scaled once (per feature: once at the end). Both compute the same products and
sums, so an int8 row, too, does not depend on its batch.

The kernel (csrc/cpu_linear.cpp) streams each 16-feature panel of the weight from memory once
per call (prefetching the next one into L2 while it computes) and reuses it from cache for every
group of up to 6 rows. On an AVX2 core (fp32) it runs at memory speed for a few rows, since the
weight is read once whatever the row count, and near the FMA peak beyond, ahead of oneDNN's
packed linear (`pdserve linearbench`; the figures are in docs/performance.md, "CPU linear
layers"). That makes scoring a few tokens per sequence (speculative verification, small decode
batches) close to the cost of one.

Each output is a sequential sum over k, so a row's result is the same whatever else is in the
batch: a sequence's logits do not depend on which other sequences, or how many proposed tokens,
share its step.

The fp32 kernel has an AVX-512 build too (csrc/cpu_linear_avx512.cpp, `linear(..., isa="avx512")`,
`available_avx512()`): the same panels, two of them per pass of up to 12 rows in 512-bit
registers, the same fused multiply-adds in the same order, so the same bits.

On Intel CPUs with AMX (Sapphire Rapids and later) a third kernel (csrc/cpu_linear_amx.cpp,
`pack_amx`, `linear_amx`, `available_amx()`) computes fp32 layers on the tile unit: each value
split into two bf16 pieces and each product taken as hi*hi + hi*lo + lo*hi with fp32 sums
("bf16x3"), within ~2^-16 of each term where plain fp32 sums are within ~2^-24 per add; its
rows, too, do not depend on their batch. Its weight has a packing of its own (the same bytes
as fp32).

The source is compiled on first use (pdkernels.cpu_build) and loaded with ctypes. It runs on torch's
thread count (torch.set_num_threads). `available()` is false where it cannot run (an x86 CPU
without AVX2 and FMA, or not x86, no compiler, a failed build) and the engine then keeps torch's
linear. It runs on AVX-512 hosts too, where the engine's default is chosen by measurement
(engine.layers.linear.linear_method_for). No autograd:
inference only. `reference` is the torch computation it must match.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from pdkernels import cpu_build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_linear.cpp"
FLAGS = cpu_build.AVX2_FLAGS
SOURCE_AVX512 = Path(__file__).with_name("csrc") / "cpu_linear_avx512.cpp"
SOURCE_AMX = Path(__file__).with_name("csrc") / "cpu_linear_amx.cpp"
ISAS = ("avx2", "avx512")   # the fp32 kernel's builds: the same panels, the same bits
PANEL = 16   # output features per packed panel (kept in step with kPanel in the source)


def reference(x: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def cpu_supported() -> bool:
    """An x86-64 CPU that runs AVX2 + FMA code (pdkernels.cpu_build.avx2_capable): AVX2-only and
    AVX-512 hosts alike. Whether the engine picks it is engine.layers.linear's choice."""
    return cpu_build.avx2_capable()


def preferred() -> bool:
    """Whether the engine picks this kernel (one of its builds) by default for float weights:
    where the host's best vector ISA is AVX2, AMD Zen 4 and Intel AVX-512 hosts
    (pdkernels.cpu_build.kernels_preferred), as measured (docs/performance.md)."""
    return cpu_build.kernels_preferred()


def preferred_avx512() -> bool:
    """Whether the engine picks the AVX-512 build by default for float weights: Intel AVX-512
    hosts (pdkernels.cpu_build.intel_avx512_host), as measured (docs/performance.md)."""
    return cpu_build.intel_avx512_host() and available_avx512()


def build(out_dir: Path | None = None) -> Path:
    """Compile the kernel (once per source and flags) and return the shared library's path."""
    return cpu_build.build(SOURCE, FLAGS, out_dir)


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if not cpu_supported():
        return None
    lib = cpu_build.load(SOURCE, FLAGS, "CPU linear kernel (torch's linear used instead)")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pdserve_linear_pack.argtypes = [ptr, i64, i64, ptr, ctypes.c_int]
    lib.pdserve_linear.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int]
    lib.pdserve_linear_pack_i8.argtypes = [ptr, i64, i64, ptr, ctypes.c_int]
    lib.pdserve_linear_i8_grouped.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, ptr, ptr,
                                              ctypes.c_int]
    lib.pdserve_linear_panel.restype = i64
    if lib.pdserve_linear_panel() != PANEL:
        log.warning("CPU linear kernel: panel width mismatch, using torch's")
        return None
    return lib


def available() -> bool:
    return _library() is not None


@functools.lru_cache(maxsize=1)
def _library512() -> ctypes.CDLL | None:
    """The fp32 kernel built for AVX-512F (csrc/cpu_linear_avx512.cpp): the AVX2 kernel's
    panels, two of them per pass of up to 12 rows in 512-bit registers."""
    if not (cpu_build.avx512_capable() and available()):   # packing is the AVX2 library's
        return None
    lib = cpu_build.load(SOURCE_AVX512, cpu_build.AVX512_FLAGS, "AVX-512 CPU linear kernel")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pdserve_linear512.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int]
    lib.pdserve_linear512_panel.restype = i64
    if lib.pdserve_linear512_panel() != PANEL:
        log.warning("AVX-512 CPU linear kernel: panel width mismatch")
        return None
    return lib


def available_avx512() -> bool:
    """Whether the AVX-512 build runs here (an AVX-512F CPU, a compiler that builds it)."""
    return _library512() is not None


def preferred_amx() -> bool:
    """Whether the engine picks the AMX kernel by default for float weights: wherever it runs
    (Intel AMX hosts: `pdkernels.cpu_build.amx_capable`), as measured (docs/performance.md,
    "The AMX kernel")."""
    return cpu_build.amx_capable() and available_amx()


@functools.lru_cache(maxsize=1)
def _library_amx() -> ctypes.CDLL | None:
    """The fp32 kernel on AMX tiles (csrc/cpu_linear_amx.cpp), with the tile state granted."""
    if not cpu_build.amx_capable():
        return None
    lib = cpu_build.load(SOURCE_AMX, cpu_build.AMX_FLAGS, "AMX CPU linear kernel")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pdserve_amx_pack.argtypes = [ptr, i64, i64, ptr, ctypes.c_int]
    lib.pdserve_amx_linear.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int]
    lib.pdserve_amx_packed_size.argtypes = [i64, i64]
    lib.pdserve_amx_packed_size.restype = i64
    lib.pdserve_amx_panel.restype = i64
    if lib.pdserve_amx_panel() != PANEL:
        log.warning("AMX CPU linear kernel: panel width mismatch")
        return None
    if lib.pdserve_amx_init() != 0:
        log.warning("AMX CPU linear kernel: the OS did not grant the tile state (Linux 5.16+ "
                    "needed)")
        return None
    return lib


def available_amx() -> bool:
    """Whether the AMX kernel runs here (an AMX CPU, an OS that grants the tile state, a
    compiler that builds it)."""
    return _library_amx() is not None


def pack_amx(weight: torch.Tensor) -> torch.Tensor:
    """The [N, K] weight for `linear_amx`: per pair of 16-feature panels and block of 32 k, its
    bf16 hi and lo pieces as two tiles (bf16 bits in an int16 tensor; zero past N and K)."""
    lib = _library_amx()
    if lib is None:
        raise RuntimeError("AMX CPU linear kernel unavailable (see available_amx())")
    _check(weight, "weight")
    w = weight.detach().contiguous()
    n, k = w.shape
    out = torch.empty(lib.pdserve_amx_packed_size(n, k), dtype=torch.int16)
    lib.pdserve_amx_pack(w.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads())
    return out


def linear_amx(x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x[..., K] @ W.T (+ bias) on AMX tiles, W from `pack_amx`, bias (if any) at least
    out_features floats (`pad_bias` will do)."""
    lib = _library_amx()
    if lib is None:
        raise RuntimeError("AMX CPU linear kernel unavailable (see available_amx())")
    _check(x, "input")
    k = x.shape[-1]
    if packed.dtype != torch.int16 or packed.numel() != lib.pdserve_amx_packed_size(
            out_features, k):
        raise ValueError(f"packed AMX weight does not hold {out_features} x {k}")
    if bias is not None and (bias.dtype != torch.float32 or bias.numel() < out_features):
        raise ValueError(f"bias must hold {out_features} float32 values")
    return _rows(x, out_features, lambda x2, m, y: lib.pdserve_amx_linear(
        x2.data_ptr(), m, k, packed.data_ptr(), out_features,
        bias.data_ptr() if bias is not None else None, y.data_ptr(), torch.get_num_threads()))


def _check(t: torch.Tensor, what: str) -> None:
    if t.device.type != "cpu" or t.dtype != torch.float32:
        raise ValueError(f"{what} must be a float32 CPU tensor, got {t.dtype} on {t.device}")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The [N, K] weight as ceil(N / 16) panels of 16 rows, k-major (zero past N)."""
    lib = _library()
    if lib is None:
        raise RuntimeError("CPU linear kernel unavailable (see available())")
    _check(weight, "weight")
    w = weight.detach().contiguous()
    n, k = w.shape
    out = torch.empty(-(-n // PANEL) * PANEL * k, dtype=torch.float32)
    lib.pdserve_linear_pack(w.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads())
    return out


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight-only int8, per output channel, symmetric: W ~= q * scale[:, None] with q in
    [-127, 127] and scale = max|W[n]| / 127 (1 for an all-zero row). -> (q int8 [N, K],
    scale float32 [N])."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def reference_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize, then matmul: what `linear_int8` must match."""
    return F.linear(x, q.float() * scale[:, None], bias)


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """An int8 [N, K] weight in the same panels as `pack` (int8 elements)."""
    lib = _library()
    if lib is None:
        raise RuntimeError("CPU linear kernel unavailable (see available())")
    if q.device.type != "cpu" or q.dtype != torch.int8:
        raise ValueError(f"weight must be an int8 CPU tensor, got {q.dtype} on {q.device}")
    w = q.detach().contiguous()
    n, k = w.shape
    out = torch.empty(-(-n // PANEL) * PANEL * k, dtype=torch.int8)
    lib.pdserve_linear_pack_i8(w.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads())
    return out


def linear_int8(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, out_features: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x[..., K] @ (q * scale).T (+ bias) with q from `pack_int8`, scale and bias from
    `pad_bias` (padded to whole panels): one group of K inputs."""
    k, panels = x.shape[-1], -(-out_features // PANEL)
    if scale.numel() != panels * PANEL:
        raise ValueError(f"scale does not hold {out_features} features in whole panels")
    return linear_int8_grouped(x, packed, scale.view(panels, 1, PANEL), k, out_features, bias)


def pack_group_scales(scale: torch.Tensor) -> torch.Tensor:
    """Group scales [N, groups] as `linear_int8_grouped` reads them: [panel, group, 16] (zero
    past N), so each group's 16 scales of a panel are one load."""
    s = scale.detach().float().contiguous()
    n, groups = s.shape
    padded = torch.zeros(-(-n // PANEL) * PANEL, groups, dtype=torch.float32)
    padded[:n] = s
    return padded.view(-1, PANEL, groups).permute(0, 2, 1).contiguous()


def linear_int8_grouped(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int,
                        out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x[..., K] @ W.T (+ bias), W[n, k] = q[n, k] * scale[n, k // group], with q from
    `pack_int8`, scales from `pack_group_scales` and bias from `pad_bias`."""
    lib = _library()
    if lib is None:
        raise RuntimeError("CPU linear kernel unavailable (see available())")
    _check(x, "input")
    _check(scales, "scales")
    k = x.shape[-1]
    panels = -(-out_features // PANEL)
    if (packed.dtype != torch.int8 or packed.numel() != panels * PANEL * k or group <= 0
            or k % group or tuple(scales.shape) != (panels, k // group, PANEL)):
        raise ValueError(f"packed int8 weight or group scales do not hold {out_features} x {k} "
                         f"in groups of {group}")
    return _rows(x, out_features, lambda x2, m, y: lib.pdserve_linear_i8_grouped(
        x2.data_ptr(), m, k, packed.data_ptr(), out_features, scales.data_ptr(), group,
        bias.data_ptr() if bias is not None else None, y.data_ptr(), torch.get_num_threads()))


def _rows(x: torch.Tensor, out_features: int, call) -> torch.Tensor:
    """y [..., out_features] for x [..., K]: `call(x2, m, y)` fills y [m, out_features] from
    the m contiguous rows x2 (not called for no rows)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    m = x2.shape[0]
    y = torch.empty(m, out_features, dtype=torch.float32)
    if m:
        call(x2, m, y)
    return y.view(*x.shape[:-1], out_features)


def pad_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """A bias zero-padded to whole panels, as `linear` reads it."""
    if bias is None:
        return None
    _check(bias, "bias")
    n = bias.numel()
    out = torch.zeros(-(-n // PANEL) * PANEL, dtype=torch.float32)
    out[:n] = bias.detach()
    return out


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
           bias: torch.Tensor | None = None, isa: str = "avx2") -> torch.Tensor:
    """x[..., K] @ W.T (+ bias) with W from `pack` and bias from `pad_bias`, computed by the
    kernel's `isa` build ("avx2", or "avx512" where `available_avx512()`): the same bits."""
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {ISAS}, got {isa!r}")
    lib = _library() if isa == "avx2" else _library512()
    if lib is None:
        raise RuntimeError(f"CPU linear kernel ({isa}) unavailable (see available())")
    fn = lib.pdserve_linear if isa == "avx2" else lib.pdserve_linear512
    _check(x, "input")
    k = x.shape[-1]
    if packed.numel() != -(-out_features // PANEL) * PANEL * k:
        raise ValueError(f"packed weight does not hold {out_features} x {k}")
    return _rows(x, out_features, lambda x2, m, y: fn(
        x2.data_ptr(), m, k, packed.data_ptr(), out_features,
        bias.data_ptr() if bias is not None else None, y.data_ptr(), torch.get_num_threads()))
