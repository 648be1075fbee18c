"""One owner of block references: the KV cache manager (engine/kv_cache_manager.py). Checked on
the source with ast: no other engine module calls a block pool's reference methods, whatever
the object is named (the pool's own module, engine/block_pool.py, defines them)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# BlockPool's methods that change a block's reference count or hand blocks out
REFERENCE_METHODS = {"allocate", "free", "take"}
OWNERS = {"engine/kv_cache_manager.py", "engine/block_pool.py"}


def _pool_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, call) of every `<something>pool.<method>(...)` / `<something>.pool.<method>(...)`
    with a reference method: calls on an object whose name ends in "pool"."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in REFERENCE_METHODS):
            continue
        target = node.func.value
        name = target.attr if isinstance(target, ast.Attribute) else \
            target.id if isinstance(target, ast.Name) else ""
        if name.lower().endswith("pool"):
            found.append((node.lineno, ast.unparse(node.func)))
    return found


def test_the_checker_finds_a_reference_change():
    tree = ast.parse("self.kv.pool.take(b)\npool.free(x)\nself.pool.allocate(2)\n"
                     "self.kv.free(rid)\nexecutor.submit(f)\n")
    assert [c for _, c in _pool_calls(tree)] == ["self.kv.pool.take", "pool.free",
                                                 "self.pool.allocate"]


def test_only_the_kv_cache_manager_changes_block_references():
    bad = {}
    for f in sorted((ROOT / "engine").rglob("*.py")):
        rel = str(f.relative_to(ROOT))
        if rel in OWNERS:
            continue
        calls = _pool_calls(ast.parse(f.read_text()))
        if calls:
            bad[rel] = calls
    assert not bad, ("block references change outside the KV cache manager (ask it instead: "
                     f"engine/kv_cache_manager.py): {bad}")
