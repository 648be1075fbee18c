"""`make gpu-check`'s script runs end to end: on CPUs, `--quick` (tiny shapes, the Triton
kernels under the interpreter) goes through every section that does not need CUDA and passes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_quick_on_cpu(tmp_path):
    out = tmp_path / "rows.jsonl"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pdserve.gpucheck", "--quick", "--device", "cpu",
                           "--families", "qwen3,gemma2", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    checks = {(r[0], r[1]) for r in rows}
    assert ("env", "versions") in checks and ("env", "grpc proto code") in checks
    assert {("parity", "qwen3 float32"), ("parity", "gemma2 float32")} <= checks
    assert {("decode", "batch 1 ctx 32 eager"), ("prefill", "32-token prompt"),
            ("int8", "batch 1 ctx 32 eager"), ("int4", "batch 1 ctx 32 eager")} <= checks
    assert all(r[4] is not False for r in rows)
    kv = {r[1].split(" (")[0]: r for r in rows if r[0] == "kv transfer"}
    assert kv["grpc send of 64 tokens"][4] and kv["torch transport"][4]   # gloo, idle gap
    offload = [r for r in rows if r[0] == "kv offload"]
    assert len(offload) == 3 and "intact" in offload[-1][2]      # store, restore, the race
    parity = [r for r in rows if r[0] == "parity"]
    assert all("greedy 12/12 same" in r[2] for r in parity) and len(parity) == 2
    assert "| section" in proc.stdout and "all checks passed" in proc.stdout


def test_unknown_sections_are_refused_and_a_spent_deadline_says_so(tmp_path):
    out = tmp_path / "rows.jsonl"
    proc = subprocess.run([sys.executable, "-m", "pdserve.gpucheck", "--quick", "--device", "cpu",
                           "--skip", "decode,nonsense"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "unknown section(s) nonsense" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "pdserve.gpucheck", "--quick", "--device", "cpu",
                           "--deadline", "0", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    import json

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    from pdserve.gpucheck import GROUPS
    assert [r[0] for r in rows] == list(GROUPS) and all(r[1] == "not run" for r in rows)
    assert proc.returncode == 1 and f"{len(GROUPS)} failed" in proc.stdout


def test_make_target_runs_the_script_without_setup():
    proc = subprocess.run(["make", "-n", "gpu-check"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0
    assert "python3 -m pdserve.gpucheck" in proc.stdout and "pip" not in proc.stdout


def test_quantized_layer_rows_read_the_layers():
    """The int8 / int4 sections' storage and grid rows (run on CUDA only): CPU layers keep int8
    values, so the storage row fails here; 8B-sized projections get their grids."""
    import torch
    from torch import nn

    from engine.layers.linear import Linear, QuantizedMethod
    from engine.layers.quant_formats import QuantScheme
    from pdserve.gpucheck import Report
    from pdserve.gpucheck_perf import quantized_layers

    model = nn.Sequential(*[Linear(k, n, method=QuantizedMethod(QuantScheme("gptq", 4, 128),
                                                                 False))
                            for n, k in ((4096, 4096), (4096, 14336))])
    for layer in model:
        layer.weight.data.zero_()
        layer.weight_scale.data.fill_(1.0)
        layer.process_weights_after_loading()
    report = Report()
    quantized_layers(report, "int4", model, True, torch.device("cpu"), quick=False)
    storage, grid = report.rows
    assert storage[1] == "storage" and storage[4] is False and "0/2" in storage[2]
    assert grid[4] is True and "4096x4096: 512" in grid[2] and "4096x14336: 576" in grid[2]
