"""The gateway must start fast and scale out cheaply: it never imports torch or transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gateway_imports_neither_torch_nor_transformers():
    code = ("import sys\n"
            "import gateway.server, gateway.openai_api, gateway.grpc_api, gateway.pipeline\n"
            "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
            "assert not heavy, f'the gateway imported {heavy}'\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
