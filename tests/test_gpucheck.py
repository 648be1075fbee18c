"""`make gpu-check`'s script runs end to end: on CPUs, `--quick` (tiny shapes, the Triton
kernels under the interpreter) goes through every section that does not need CUDA and passes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_quick_on_cpu(tmp_path):
    out = tmp_path / "rows.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pdserve.gpucheck", "--quick", "--device", "cpu",
                           "--families", "qwen3", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json

    rows = json.loads(out.read_text())
    checks = {(r[0], r[1]) for r in rows}
    assert ("parity", "qwen3 float32") in checks
    assert {("decode", "batch 1 ctx 32 eager"), ("prefill", "32-token prompt"),
            ("int8", "batch 1 ctx 32 eager"), ("int4", "batch 1 ctx 32 eager")} <= checks
    assert all(r[4] is not False for r in rows)
    parity = next(r for r in rows if r[0] == "parity")
    assert "greedy 12/12 same" in parity[2]
    assert "| section" in proc.stdout and "all checks passed" in proc.stdout


def test_make_target_runs_the_script_without_setup():
    proc = subprocess.run(["make", "-n", "gpu-check"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0
    assert "python3 -m pdserve.gpucheck" in proc.stdout and "pip" not in proc.stdout
