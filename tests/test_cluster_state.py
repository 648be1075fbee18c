"""cluster/ holds no process-wide state: credentials and settings are built by each process's
main and passed to what uses them (ClusterAuth, RedisSettings), so two of them can live in one
process (tests do) and nothing reads a value some other code set earlier."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CLUSTER = Path(__file__).resolve().parent.parent / "cluster"
MUTABLE_CALLS = {"dict", "list", "set", "bytearray", "deque", "defaultdict", "OrderedDict",
                 "Counter"}


def _mutable(value: ast.expr | None) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        fn = value.func
        name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) \
            else None
        return name in MUTABLE_CALLS
    return False


def _module_state(tree: ast.Module) -> list[str]:
    found = [f"line {n.lineno}: global {', '.join(n.names)}" for n in ast.walk(tree)
             if isinstance(n, ast.Global)]
    for node in tree.body:
        if isinstance(node, ast.Assign) and _mutable(node.value):
            found.append(f"line {node.lineno}: {ast.unparse(node.targets[0])} = a mutable "
                         "container")
        elif isinstance(node, ast.AnnAssign) and _mutable(node.value):
            found.append(f"line {node.lineno}: {ast.unparse(node.target)} = a mutable container")
    return found


def test_the_check_finds_state():
    tree = ast.parse("import collections\nA = {}\nB: set = set()\nC = collections.deque()\n"
                     "D = (1, 2)\ndef f():\n    global D\n")
    assert len(_module_state(tree)) == 4


@pytest.mark.parametrize("path", sorted(CLUSTER.glob("*.py")), ids=lambda p: p.name)
def test_cluster_has_no_module_state(path):
    assert not _module_state(ast.parse(path.read_text())), _module_state(
        ast.parse(path.read_text()))
