"""fp32 linear layers on x86 CPUs with AVX2: y = x @ W.T (+ b) with W packed once, at load time.

The kernel (csrc/cpu_linear.cpp) streams each 16-feature panel of the weight from memory once
per call (prefetching the next one into L2 while it computes) and reuses it from cache for every
group of up to 6 rows. On an AVX2 core (fp32) it runs at memory speed up to ~9 rows and near the
FMA peak beyond, where oneDNN's packed linear reaches 60-80% of it (`pdserve linearbench`, the
default model's projections and lm_head, one thread: 1 row 33 vs 36 ms, 9 rows 34 vs 64 ms,
17 rows 53 vs 94 ms, 128 rows 92 vs 75 GFLOPS).
That makes scoring a few tokens per sequence (speculative verification, small decode batches)
close to the cost of one.

Each output is a sequential sum over k, so a row's result is the same whatever else is in the
batch: a sequence's logits do not depend on which other sequences, or how many proposed tokens,
share its step.

The source is compiled on first use with the system C++ compiler ($CXX, else c++) into
$PDSERVE_KERNEL_CACHE (default: the `kernels` folder of pdserve's cache, ~/.cache/pdserve or
$PDSERVE_CACHE), keyed by a hash of source and flags, and loaded with ctypes. It runs on torch's
thread count (torch.set_num_threads). `available()` is false where it cannot run (not an AVX2
x86 CPU, no compiler, a failed build) and the engine then keeps torch's linear. No autograd:
inference only. `reference` is the torch computation it must match.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_linear.cpp"
FLAGS = ["-O3", "-std=c++17", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared"]
PANEL = 16   # output features per packed panel (kept in step with kPanel in the source)


def reference(x: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def cache_dir() -> Path:
    """PDSERVE_KERNEL_CACHE, else the same cache root as pdserve.paths.cache_dir() (which this
    package may not import) + /kernels."""
    for env, sub in (("PDSERVE_KERNEL_CACHE", ""), ("PDSERVE_CACHE", "kernels")):
        if os.environ.get(env):
            return Path(os.environ[env]).expanduser() / sub
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "pdserve" / "kernels"


def cpu_supported() -> bool:
    """An x86-64 CPU whose best vector ISA, as torch sees it, is AVX2 (where this was measured;
    on AVX-512 and AMX hosts oneDNN uses the wider units and stays in charge)."""
    return (platform.machine().lower() in ("x86_64", "amd64")
            and torch.backends.cpu.get_cpu_capability() == "AVX2")


def build(out_dir: Path | None = None) -> Path:
    """Compile the kernel (once per source and flags) and return the shared library's path."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler (set CXX, or install g++)")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"cpu_linear-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # Several workers may start at once: each compiles to its own file, the rename is atomic.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        try:
            proc = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True,
                                  text=True)
        except OSError as e:
            raise RuntimeError(f"cannot run the C++ compiler {cxx}: {e}") from e
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed on {SOURCE.name}:\n{proc.stderr[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("compiled %s in %.1f s -> %s", SOURCE.name, time.perf_counter() - t0, lib)
    return lib


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if not cpu_supported():
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError) as e:
        log.warning("CPU linear kernel unavailable, using torch's: %s", e)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pdserve_linear_pack.argtypes = [ptr, i64, i64, ptr, ctypes.c_int]
    lib.pdserve_linear.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int]
    lib.pdserve_linear_panel.restype = i64
    if lib.pdserve_linear_panel() != PANEL:
        log.warning("CPU linear kernel: panel width mismatch, using torch's")
        return None
    return lib


def available() -> bool:
    return _library() is not None


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
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x[..., K] @ W.T (+ bias) with W from `pack` and bias from `pad_bias`."""
    lib = _library()
    if lib is None:
        raise RuntimeError("CPU linear kernel unavailable (see available())")
    _check(x, "input")
    k = x.shape[-1]
    if packed.numel() != -(-out_features // PANEL) * PANEL * k:
        raise ValueError(f"packed weight does not hold {out_features} x {k}")
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    y = torch.empty(m, out_features, dtype=torch.float32)
    if m:
        lib.pdserve_linear(x2.data_ptr(), m, k, packed.data_ptr(), out_features,
                           bias.data_ptr() if bias is not None else None, y.data_ptr(),
                           torch.get_num_threads())
    return y.view(*x.shape[:-1], out_features)
