"""Compiling the CPU kernels in pdkernels/csrc: once per source and flags, on first use.

A source is compiled with the system C++ compiler ($CXX, else c++) into $PDSERVE_KERNEL_CACHE
(default: the `kernels` folder of pdserve's cache, ~/.cache/pdserve or $PDSERVE_CACHE), named by
a hash of source and flags, and loaded with ctypes by its Python module. Several workers may
start at once: each compiles to a file of its own and renames it into place (atomic).
"""

from __future__ import annotations

import ctypes
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

log = logging.getLogger(__name__)

AVX2_FLAGS = ["-O3", "-std=c++17", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared"]
AVX512_FLAGS = ["-O3", "-std=c++17", "-mavx512f", "-mavx2", "-mfma", "-fopenmp", "-fPIC",
                "-shared"]

AMX_FLAGS = ["-O3", "-std=c++17", "-mamx-tile", "-mamx-bf16", "-mavx512f", "-mavx512bf16",
             "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared"]


def cache_dir() -> Path:
    """PDSERVE_KERNEL_CACHE, else the same cache root as cluster.paths.cache_dir() (which this
    package may not import) + /kernels."""
    for env, sub in (("PDSERVE_KERNEL_CACHE", ""), ("PDSERVE_CACHE", "kernels")):
        if os.environ.get(env):
            return Path(os.environ[env]).expanduser() / sub
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "pdserve" / "kernels"


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (None where there is no such file)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return set()


def avx2_capable() -> bool:
    """An x86-64 CPU that can run the AVX2 + FMA kernels: AVX2-only hosts and AVX-512 ones
    alike (every AVX-512 CPU has AVX2 and FMA)."""
    if not _x86():
        return False
    flags = cpu_flags()
    if flags is not None:
        return {"avx2", "fma"} <= flags
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def avx512_capable() -> bool:
    """An x86-64 CPU that can run the AVX-512F kernels (Intel since Skylake-SP, AMD since
    Zen 4)."""
    flags = cpu_flags() if _x86() else None
    return bool(flags) and {"avx512f", "avx2", "fma"} <= flags


def amx_capable() -> bool:
    """An x86-64 CPU with AMX tiles and their bf16 products, and AVX-512 BF16 conversions
    (Intel since Sapphire Rapids), as /proc/cpuinfo lists them. The process must still be
    granted the tile state (Linux 5.16+), which pdkernels.cpu_linear asks for when it loads the
    AMX kernel."""
    flags = cpu_flags() if _x86() else None
    return bool(flags) and {"amx_tile", "amx_bf16", "avx512f", "avx512_bf16", "avx512bw",
                            "avx512vl"} <= flags


def avx2_host() -> bool:
    """An x86-64 CPU whose best vector ISA, as torch sees it, is AVX2 (on AVX-512 and AMX hosts
    the AVX2 kernels still run, when asked for)."""
    return _x86() and avx2_capable() and torch.backends.cpu.get_cpu_capability() == "AVX2"


def cpuinfo_field(name: str) -> str | None:
    """A field of the first CPU in /proc/cpuinfo ("vendor_id", "cpu family", ...), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        return None
    return None


ZEN4_FAMILY = "25"   # AMD family 19h: Zen 3 (no AVX-512) and Zen 4 (AVX-512 on 256-bit units)


def kernels_preferred() -> bool:
    """Where the engine picks our kernels (linear and attention) by default: hosts whose best
    ISA is AVX2; AMD Zen 4 hosts, whose AVX-512 runs on 256-bit units, so 256-bit code loses no
    width there; and Intel AVX-512 hosts, where the linear kernel runs its AVX-512 build
    (`intel_avx512_host`). Each measured faster than oneDNN and gather + SDPA
    (docs/performance.md, "CPU paths side by side"). Zen 5 (full-width units) keeps oneDNN and
    SDPA until measured."""
    if not (_x86() and avx2_capable()):
        return False
    return avx2_host() or intel_avx512_host() or (
        cpuinfo_field("vendor_id") == "AuthenticAMD" and cpuinfo_field("cpu family") == ZEN4_FAMILY)


def intel_avx512_host() -> bool:
    """An Intel CPU with AVX-512F (Skylake-SP and later: two full-width FMA units on most
    server parts), where the engine picks the AVX-512 build of our linear kernel by default
    and our AVX2 attention kernel, as measured faster than oneDNN, our AVX2 linear and gather +
    SDPA there (docs/performance.md, "CPU paths side by side")."""
    return avx512_capable() and cpuinfo_field("vendor_id") == "GenuineIntel"


def load(source: Path, flags: list[str], what: str) -> ctypes.CDLL | None:
    """`source` built with `flags` and loaded, or None with a warning naming `what` and why
    (no compiler, a failed build, a library that does not load)."""
    try:
        return ctypes.CDLL(str(build(source, flags)))
    except (OSError, RuntimeError) as e:
        log.warning("%s unavailable: %s", what, e)
        return None


def build(source: Path, flags: list[str], out_dir: Path | None = None) -> Path:
    """Compile `source` (once per source and flags) and return the shared library's path."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler (set CXX, or install g++)")
    key = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"{source.stem}-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        try:
            proc = subprocess.run([cxx, *flags, str(source), "-o", tmp], capture_output=True,
                                  text=True)
        except OSError as e:
            raise RuntimeError(f"cannot run the C++ compiler {cxx}: {e}") from e
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed on {source.name}:\n{proc.stderr[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("compiled %s in %.1f s -> %s", source.name, time.perf_counter() - t0, lib)
    return lib
