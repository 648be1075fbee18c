"""The dependency rules of ARCHITECTURE.md, checked on the source (imports parsed with ast)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = {"engine", "kernels", "kvtransfer", "prefill_service", "decode_service", "gateway",
        "proto", "pdserve"}

# package -> top-level modules it must never import
FORBIDDEN = {
    "engine": {"grpc", "redis", "proto", "kvtransfer", "prefill_service", "decode_service",
               "gateway", "pdserve", "fastapi"},
    "kernels": OURS - {"kernels"} | {"grpc", "redis"},
    "kvtransfer": {"prefill_service", "decode_service", "gateway", "redis"},
    "gateway": {"torch", "transformers", "engine", "kernels", "kvtransfer", "prefill_service",
                "decode_service", "safetensors", "triton"},
    "prefill_service": {"gateway", "decode_service"},
    "decode_service": {"gateway", "prefill_service"},
}


# The one torch-free engine module the gateway and the Redis directory share (ARCHITECTURE.md).
SHARED = {"engine.block_hash"}


def imports_of(package: str) -> dict[str, set[str]]:
    out = {}
    for f in (ROOT / package).rglob("*.py"):
        if f.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        mods = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                mods |= {a.name.split(".")[0] for a in node.names if a.name not in SHARED}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module not in SHARED:
                    mods.add(node.module.split(".")[0])
        out[str(f.relative_to(ROOT))] = mods
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_dependencies_point_one_way(package):
    bad = {f: sorted(m & FORBIDDEN[package]) for f, m in imports_of(package).items()
           if m & FORBIDDEN[package]}
    assert not bad, f"{package} imports what it must not: {bad}"


def test_shared_hash_module_is_standard_library_only():
    mods: set[str] = set()
    tree = ast.parse((ROOT / "engine" / "block_hash.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module.split(".")[0])
    assert mods <= set(sys.stdlib_module_names) | {"__future__"}, mods


def test_gateway_starts_without_torch():
    code = ("import sys, gateway.server, pdserve.cli, pdserve.registry; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
            "or m.startswith('engine.') and m not in %r]; "
            "assert not bad, bad" % (SHARED,))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_transformers_does_not_take_our_kernels_package():
    code = ("import kernels, transformers.utils.import_utils as iu; "
            "assert not iu.is_kernels_available(), 'transformers sees our kernels package'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_top_level_layout():
    for name in ["pyproject.toml", "README.md", "Makefile", "Dockerfile", "docker-compose.yml",
                 ".ci/run", "proto/pdserve.proto", *[f"{p}/__init__.py" for p in sorted(OURS)]]:
        assert (ROOT / name).exists(), name


def test_the_cpu_engine_does_not_import_triton():
    """Triton (a large import) loads only with the triton attention backend."""
    code = ("import sys, engine.engine, engine.model_runner, engine.attention.torch_backend; "
            "print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
