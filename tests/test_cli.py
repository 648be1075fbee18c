"""`pdserve --help` and every command's help: torch-free, since building the parser imports only
what the commands register (each tool's flags live in its module, its heavy imports in the
function that runs). No parser takes an abbreviation of a flag."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve import cli
from pdserve.flags import ROLES, role_parser

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


def _all_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _all_parsers(child, path + (name,))


def test_no_parser_takes_an_abbreviated_flag():
    """Every command's parser (and each role's standalone one, which `up` checks
    --ROLE-args with) has prefix matching off; so has every parser a module makes itself."""
    found = list(_all_parsers(cli.build_parser()))
    assert len(found) > 20
    assert [" ".join(path) for path, p in found if p.allow_abbrev] == []
    assert [role for role in ROLES if role_parser(role).allow_abbrev] == []
    sources = [path for top in ROOT.iterdir() if top.is_dir() and top.name[0] not in "._"
               and top.name != "tests" for path in top.rglob("*.py")]
    assert ROOT / "pdserve" / "gpucheck.py" in sources
    lax = [f"{path.relative_to(ROOT)}:{call.lineno}" for path in sources
           for call in _argument_parser_calls(path) if not _no_abbrev(call)]
    assert lax == []


def _argument_parser_calls(path: Path) -> list[ast.Call]:
    return [node for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "ArgumentParser"]


def _no_abbrev(call: ast.Call) -> bool:
    return any(k.arg == "allow_abbrev" and isinstance(k.value, ast.Constant)
               and k.value.value is False for k in call.keywords)


@pytest.mark.parametrize("argv", [
    ["gateway", "--api-key-fil", "keys.txt"],           # once read as --api-key-file
    ["up", "--api-key-f", "keys.txt"],
    ["up", "--http-po", "8001"],
    ["decode", "--max-num-se", "4"],
    ["chaos", "--dur", "5"],
])
def test_an_abbreviated_flag_is_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert f"unrecognized arguments: {argv[1]}" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["up", "gateway"])
def test_api_key_is_a_key_on_up_and_the_gateway(command):
    """vLLM's `--api-key KEY`: a key (repeatable), never a prefix of --api-key-file."""
    args = cli.build_parser().parse_args([command, "--api-key", "sk-one", "--api-key", "sk-two",
                                          "--api-key-file", "keys.txt"])
    assert (args.api_key, args.api_key_file) == (["sk-one", "sk-two"], "keys.txt")
    args = cli.build_parser().parse_args([command, "--api-key", "sk-one"])
    assert (args.api_key, args.api_key_file) == (["sk-one"], None)
