"""Every Triton kernel compiled ahead of time for a GPU, on a machine without one.

`python -m pdkernels.aot` (make kernels-aot) runs the cases of pdkernels.aot_cases: each kernel's
own wrapper, called on CPU tensors as the engine calls it. A stand-in driver gives Triton's
launcher the GPU target (sm_90 unless --arch), and Triton's jit_cache_hook records every launch
a wrapper makes -- signature, constexprs, divisibility attributes, num_warps, num_stages, as the
launcher specializes them on a GPU -- in place of compiling and running it. Each distinct launch
is then compiled by triton.compile for that target (worker processes, Triton's cache) and read:
registers and bytes of spill stores per thread from the log of Triton's own ptxas step (run
with -v; Triton reads n_regs and n_spills only when it loads a kernel onto a device), and the
shared memory Triton allocates.

The check fails (exit status 1) on a case that raises or launches nothing, a compile error,
shared memory over the target's limit, or any spill in a 16-bit dtype; fp32 spills are
reported only.

Triton's interpreter (TRITON_INTERPRET=1, which the tests set) replaces kernels when they are
imported, so main() runs itself again without it before importing any kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import json
import os
import re
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.compiler import ASTSource, make_backend
from triton.runtime.driver import driver

# Shared memory one block may use, bytes (opt-in maximum), by compute capability.
SHARED_LIMIT = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448,
                120: 101376}
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores")


@dataclass(frozen=True)
class Launch:
    """One kernel launch as Triton's launcher specialized it: enough to compile it anywhere."""

    module: str
    name: str
    signature: dict
    constexprs: dict      # (argument index,) -> value
    attrs: dict           # (argument index,) -> [["tt.divisibility", 16]] or []
    options: dict         # the options that differ from the backend's defaults (num_warps...)
    num_warps: int
    num_stages: int

    def key(self) -> str:
        return repr((self.module, self.name, sorted(self.signature.items()),
                     sorted(self.constexprs.items()), sorted(self.attrs.items()),
                     sorted(self.options.items())))

    def constexpr_text(self) -> str:
        names = list(self.signature)
        return " ".join(f"{names[i]}={v}" for (i,), v in sorted(self.constexprs.items()))


@dataclass
class Row:
    """A table row: one distinct launch (or a case that failed before launching), filled in by
    compile_rows."""

    entry: str
    dtype: torch.dtype
    params: str
    launch: Launch | None
    cases: int = 1
    regs: int = 0
    spills: int = 0
    shared: int = 0
    error: str = ""

    @property
    def failed(self) -> bool:
        return bool(self.error) or (self.spills > 0 and self.dtype != torch.float32)


class _CaptureDriver(DriverBase):
    """Answers the launcher's questions for a GPU that is not there; nothing runs on it."""

    def __init__(self, target: GPUTarget) -> None:
        super().__init__()
        self.target = target

    @classmethod
    def is_active(cls) -> bool:
        return False

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("capture only")

    def get_benchmarker(self):
        raise NotImplementedError("capture only")


@functools.lru_cache(maxsize=None)
def _default_options(target: GPUTarget) -> dict:
    return json.loads(json.dumps(make_backend(target).parse_options({}).__dict__))


def _non_default_options(target: GPUTarget, options: dict) -> dict:
    """The launch's options that differ from the backend's defaults (JSON values compared)."""
    defaults = _default_options(target)
    return {k: v for k, v in options.items() if defaults.get(k) != v}


def capture(call, target: GPUTarget) -> list[Launch]:
    """The launches call() makes, recorded by Triton's jit_cache_hook: nothing compiles or runs.
    The stand-in driver stays active afterwards (this module's process is a compile check)."""
    launches: list[Launch] = []

    def hook(*, fn, compile, **_) -> bool:
        data = json.loads(compile["specialization_data"])
        launches.append(Launch(fn.module, fn.name, dict(compile["signature"]),
                               dict(compile["constants"]), dict(compile["configs"][0]),
                               _non_default_options(target, data["options"]),
                               compile["num_warps"], compile["num_stages"]))
        return True                              # handled: do not compile, do not launch

    driver.set_active(_CaptureDriver(target))
    previous, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, hook
    try:
        call()
    finally:
        knobs.runtime.jit_cache_hook = previous
    return launches


def parse_ptxas_log(text: str) -> tuple[int, int]:
    """(registers, bytes of spill stores per thread) from `ptxas -v` output: the most registers
    any function uses, the spill stores of all."""
    regs = [int(n) for n in _REGISTERS.findall(text)]
    if not regs:
        raise RuntimeError(f"no register count in ptxas's output:\n{text}")
    return max(regs), sum(int(n) for n in _SPILLS.findall(text))


def _with_ptxas_log(compile_) -> tuple[object, str]:
    """compile_()'s result and what ptxas -v printed meanwhile (Triton passes -v and prints the
    log when asked to)."""
    log = io.StringIO()
    previous, knobs.nvidia.dump_ptxas_log = knobs.nvidia.dump_ptxas_log, True
    try:
        with contextlib.redirect_stdout(log):     # also swallows the PTX Triton prints on errors
            result = compile_()
    finally:
        knobs.nvidia.dump_ptxas_log = previous
    return result, log.getvalue()


def compile_launch(launch: Launch, arch: int) -> tuple[int, int, int, str]:
    """(registers, spill bytes, shared memory bytes, error) of the launch compiled for
    sm_<arch>. A kernel from Triton's cache ran no ptxas: its PTX is assembled again by the
    backend's own ptxas step for the log."""
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION")
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    try:
        fn = getattr(importlib.import_module(launch.module), launch.name)
        src = ASTSource(fn, launch.signature, launch.constexprs, launch.attrs)
        kernel, log = _with_ptxas_log(
            lambda: triton.compile(src, target=target, options=launch.options))
        if not _REGISTERS.search(log):
            opt = backend.parse_options(launch.options)
            _, log = _with_ptxas_log(lambda: backend.make_cubin(kernel.asm["ptx"], {}, opt, arch))
        regs, spills = parse_ptxas_log(log)
    except Exception as e:                       # a compile error is this check's finding
        return 0, 0, 0, f"{type(e).__name__}: {str(e).strip()[:2000]}"
    shared = kernel.metadata.shared
    limit = SHARED_LIMIT.get(arch)
    if limit is not None and shared > limit:
        return regs, spills, shared, f"shared memory {shared} B over sm_{arch}'s {limit} B"
    return regs, spills, shared, ""


def collect(matrix, entries: list[str], target: GPUTarget) -> tuple[list[Row], int]:
    """Rows of the distinct launches every case of `entries` makes (a case that raises or
    launches nothing is a failed row), and the number of cases run."""
    if knobs.runtime.interpret:
        raise RuntimeError("TRITON_INTERPRET is set: kernels would run in the interpreter "
                           "(run python -m pdkernels.aot, which drops it)")
    from pdkernels.aot_cases import ENTRIES

    rows: list[Row] = []
    seen: dict[tuple, Row] = {}
    cases = 0
    for entry in entries:
        for shape in matrix.shapes:
            for dtype in matrix.dtypes:
                for params, call in ENTRIES[entry](shape, dtype, matrix):
                    cases += 1
                    try:
                        launches = capture(call, target)
                    except Exception as e:
                        rows.append(Row(entry, dtype, params, None,
                                        error=f"the wrapper raised {type(e).__name__}: {e}"))
                        continue
                    if not launches:
                        rows.append(Row(entry, dtype, params, None, error="launched nothing"))
                    for launch in launches:
                        key = (dtype, launch.key())
                        if key in seen:
                            seen[key].cases += 1
                        else:
                            seen[key] = Row(entry, dtype, params, launch)
                            rows.append(seen[key])
    return rows, cases


def compile_rows(rows: list[Row], arch: int, jobs: int) -> None:
    """Compiles every row's launch, in `jobs` processes, and fills in its resource usage."""
    todo = [r for r in rows if r.launch is not None]
    if jobs > 1 and len(todo) > 1:
        with ProcessPoolExecutor(min(jobs, len(todo)), mp_context=get_context("spawn")) as pool:
            results = list(pool.map(compile_launch, [r.launch for r in todo], [arch] * len(todo)))
    else:
        results = [compile_launch(r.launch, arch) for r in todo]
    for row, (regs, spills, shared, error) in zip(todo, results):
        row.regs, row.spills, row.shared, row.error = regs, spills, shared, error


def _kernel_name(row: Row) -> str:
    if row.launch is None:
        return row.entry
    return row.launch.name.strip("_").removesuffix("_kernel")


def format_table(rows: list[Row], verbose: bool = False) -> str:
    """One line per distinct launch: kernel, dtype, params (the first case that made it, and
    how many more did), warps / stages, registers and bytes of spill stores per thread, shared
    memory bytes per program, status."""
    head = ["kernel", "dtype", "params", "warps", "stages", "regs", "spill B", "shared B",
            "status"]
    if verbose:
        head.append("constexprs")
    table = [head]
    for r in rows:
        more = f" (+{r.cases - 1})" if r.cases > 1 else ""
        spill_note = "spills (fp32: reported)" if r.spills and r.dtype == torch.float32 else ""
        status = ("FAIL" + (": spills" if not r.error else ": error")) if r.failed else \
            (spill_note or "ok")
        line = [_kernel_name(r), DTYPE_NAMES[r.dtype], r.params + more,
                str(r.launch.num_warps) if r.launch else "-",
                str(r.launch.num_stages) if r.launch else "-",
                str(r.regs), str(r.spills), str(r.shared), status]
        if verbose:
            line.append(r.launch.constexpr_text() if r.launch else "")
        table.append(line)
    widths = [max(len(line[i]) for line in table) for i in range(len(head))]
    numeric = {3, 4, 5, 6, 7}
    out = []
    for n, line in enumerate(table):
        cells = [c.rjust(w) if i in numeric and n else c.ljust(w)
                 for i, (c, w) in enumerate(zip(line, widths))]
        out.append("  ".join(cells).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _parse(argv: list[str]) -> argparse.Namespace:
    from pdkernels.aot_cases import ENTRIES

    p = argparse.ArgumentParser(
        prog="python -m pdkernels.aot", allow_abbrev=False,
        description="Compile every Triton kernel of pdkernels/ for a CUDA GPU without one, at the "
                    "launch parameters the engine uses, and report registers, spills and shared "
                    "memory. Exit status 1 on a compile error, shared memory over the limit or "
                    "a register spill in bf16 / fp16 (fp32 spills are reported only).")
    p.add_argument("--quick", action="store_true",
                   help="the subset the test suite compiles: bf16 and fp16, block size 16, "
                        "fewer step sizes and weight schemes (default: the full matrix)")
    p.add_argument("--kernels", default=",".join(ENTRIES),
                   help=f"comma-separated entries (default: all of {','.join(ENTRIES)})")
    p.add_argument("--dtypes", default="",
                   help="comma-separated subset of bf16,fp16,fp32 (default: the matrix's)")
    p.add_argument("--arch", type=int, default=90,
                   help="CUDA compute capability to compile for (default 90: H100 / H200)")
    p.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 8),
                   help="compile processes (default: the CPU count, at most 8)")
    p.add_argument("--verbose", action="store_true", help="add each launch's constexprs")
    args = p.parse_args(argv)
    unknown = set(args.kernels.split(",")) - set(ENTRIES)
    if unknown:
        p.error(f"unknown kernels {sorted(unknown)}; known: {', '.join(ENTRIES)}")
    names = {v: k for k, v in DTYPE_NAMES.items()}
    if args.dtypes and not set(args.dtypes.split(",")) <= set(names):
        p.error(f"--dtypes takes {','.join(names)}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "TRITON_INTERPRET" in os.environ:       # the kernels would be imported as interpreted
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        os.execve(sys.executable, [sys.executable, "-m", "pdkernels.aot", *argv], env)
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION")
    args = _parse(argv)
    from dataclasses import replace

    from pdkernels.aot_cases import FULL, QUICK

    matrix = QUICK if args.quick else FULL
    if args.dtypes:
        wanted = args.dtypes.split(",")
        matrix = replace(matrix, dtypes=tuple(d for d in matrix.dtypes
                                              if DTYPE_NAMES[d] in wanted))
    start = time.monotonic()
    target = GPUTarget("cuda", args.arch, 32)
    rows, cases = collect(matrix, args.kernels.split(","), target)
    compile_rows(rows, args.arch, args.jobs)
    print(format_table(rows, args.verbose))
    failed = [r for r in rows if r.failed]
    for r in failed:
        print(f"\nFAIL {_kernel_name(r)} {DTYPE_NAMES[r.dtype]} {r.params}: "
              f"{r.error or f'{r.spills} bytes of spill stores per thread'}")
    compiled = sum(r.launch is not None for r in rows)
    print(f"\n{compiled} distinct launches from {cases} cases, compiled for sm_{args.arch} in "
          f"{time.monotonic() - start:.0f} s with {args.jobs} processes: "
          f"{'all ok' if not failed else f'{len(failed)} FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
