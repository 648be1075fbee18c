"""`pdserve chaos` for 100 seconds (a fault every 15): 2 prefill + 2 decode workers, the gateway and Redis under a
steady streaming load while workers are killed (-9) and restarted, stopped (SIGSTOP) and
resumed, and Redis is stopped and restarted; the decode workers take over prompts whose KV is
late. Every answer that completes equals the known one, no request hangs, every failure is an
OpenAI-style error, every stopped worker is found, and no worker holds a block or a request at
the end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.stack import ROOT

pytestmark = pytest.mark.slow


def test_chaos(model_dir, tmp_path):
    out = tmp_path / "chaos.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "chaos", "--model", str(model_dir),
         "--duration", "100", "--kill-interval", "15", "--restart-delay", "3",
         "--concurrency", "3", "--max-tokens", "16", "--hang-timeout", "90", "--seed", "7",
         "--faults", "kill,hang", "--hang-seconds", "12", "--recompute", "3",
         "--workdir", str(tmp_path / "logs"), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=570)
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    report = json.loads(out.read_text())
    assert report["hung"] == 0
    assert report["completed_different"] == 0
    assert not any(report["blocks_leaked"].values()), report["blocks_leaked"]
    assert not any(report["requests_left"].values()), report["requests_left"]
    assert report["completed_token_exact"] > 0 and sum(report["kills"].values()) >= 2
    hangs = sum(report["hangs"].values())
    assert hangs >= 2 and report["workers_found_hung"] + report["prompts_taken_over"] >= 1, report
    assert not [r for r in report["failed"] if "not an OpenAI error body" in r], report["failed"]
    assert proc.returncode == 0
