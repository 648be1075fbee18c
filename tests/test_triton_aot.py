"""The Triton kernels compile for an sm_90 GPU on a machine without one (pdkernels.aot --quick:
bf16 and fp16, block size 16, fewer step sizes and weight schemes than `make kernels-aot`), with
no register spill, at the launch parameters their wrappers choose."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdkernels import aot

ROOT = Path(__file__).resolve().parents[1]

PTXAS_LOG = """
ptxas info    : 11 bytes gmem, 8 bytes cmem[4]
ptxas info    : Compiling entry function '_paged_attention_kernel' for 'sm_90a'
ptxas info    : Function properties for _paged_attention_kernel
    384 bytes stack frame, 408 bytes spill stores, 392 bytes spill loads
ptxas info    : Used 104 registers, used 1 barriers, 384 bytes cumulative stack size
"""


def test_ptxas_log_gives_registers_and_spill_stores():
    assert aot.parse_ptxas_log(PTXAS_LOG) == (104, 408)
    assert aot.parse_ptxas_log("ptxas info    : Used 26 registers, used 0 barriers") == (26, 0)
    with pytest.raises(RuntimeError):
        aot.parse_ptxas_log("ptxas info    : Compiling entry function")


def test_spills_fail_16_bit_dtypes_only():
    def row(dtype, spills, error=""):
        return aot.Row("rms_norm", dtype, "p", None, spills=spills, error=error)

    assert row(torch.bfloat16, 1).failed and row(torch.float16, 2).failed
    assert not row(torch.float32, 3).failed and not row(torch.bfloat16, 0).failed
    assert row(torch.float32, 0, error="CompilationError").failed
    table = aot.format_table([row(torch.float32, 3), row(torch.float16, 2)])
    assert "spills (fp32: reported)" in table.splitlines()[2]
    assert "FAIL: spills" in table.splitlines()[3]


@pytest.fixture(scope="module")
def quick_run():
    # TRITON_INTERPRET=1 (conftest) stays set: pdkernels.aot runs itself again without it.
    assert "TRITON_INTERPRET" in os.environ
    proc = subprocess.run([sys.executable, "-m", "pdkernels.aot", "--quick", "--verbose",
                           "--jobs", "2"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    return proc


def _rows(stdout: str) -> list[list[str]]:
    lines = stdout.splitlines()
    end = lines.index("")
    return [line.split() for line in lines[2:end]]


def test_every_kernel_compiles_for_sm90_without_spills(quick_run):
    assert quick_run.returncode == 0, quick_run.stdout[-6000:] + quick_run.stderr[-3000:]
    assert "all ok" in quick_run.stdout.splitlines()[-1]
    rows = _rows(quick_run.stdout)
    kernels = {(r[0], r[1]) for r in rows}
    for name in ("paged_attention", "merge_splits", "store_kv", "rms_norm", "silu_and_mul",
                 "quant_linear", "shrink", "expand"):     # (the last two: LoRA's)
        assert {(name, "bf16"), (name, "fp16")} <= kernels, name


def test_launches_carry_the_wrappers_constexprs(quick_run):
    """Rows are compiled at what the wrappers choose (here rms_norm's for D 576, and the
    split-KV decode), not at numbers of the check's own."""
    lines = quick_run.stdout.splitlines()
    norm = next(line for line in lines if "135M [16, 576] + residual" in line and "bf16" in line)
    assert "D=576 BLOCK_D=1024 BLOCK_R=2 HAS_RES=True" in norm
    split = next(line for line in lines
                 if line.startswith("paged_attention") and "16 splits" in line)
    assert "BLOCK_M=16" in split and "SPLIT=True" in split
