"""`pdserve --help` and every command's help: torch-free, since building the parser imports only
what the commands register (each tool's flags live in its module, its heavy imports in the
function that runs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

HELP_OF_EVERY_COMMAND = """
import argparse, sys
from pdserve import cli

def parsers(p, path=()):
    yield path, p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from parsers(child, path + (name,))

seen = []
for path, p in parsers(cli.build_parser()):
    assert p.format_help().startswith("usage: pdserve"), path
    seen.append(" ".join(path))
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
print("\\n".join(seen))
assert not heavy, heavy[:5]
"""


def test_help_of_every_command_does_not_import_torch():
    out = subprocess.run([sys.executable, "-c", HELP_OF_EVERY_COMMAND], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    commands = set(out.stdout.split("\n"))
    assert {"", "up", "gateway", "prefill", "decode", "bench", "bench compare", "kvbench",
            "grammarbench", "stepbench", "model fetch", "model quantize", "baseline hf",
            "chaos", "secrets"} <= commands, commands


def test_top_level_help_runs_without_torch():
    code = ("import runpy, sys; sys.argv = ['pdserve', '--help']\n"
            "try:\n    runpy.run_module('pdserve.cli', run_name='__main__')\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')]")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "COMMAND" in out.stdout
