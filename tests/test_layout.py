"""The floors of ARCHITECTURE.md, checked on the source (imports parsed with ast).

Each package of ours lives on a floor and imports only packages on floors below it, never a
neighbour on its own floor; the torch-free packages import nothing that imports torch; and no
module of ours reaches itself through its imports (an import circle), lazy imports included."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Bottom to top. A package imports only packages on lower floors.
FLOORS = [
    ("pdkernels", "proto"),
    ("engine", "cluster"),               # compute beside the torch-free deployment floor
    ("kvtransfer", "gateway"),
    ("serving",),                        # what both workers share
    ("prefill_service", "decode_service"),
    ("pdserve",),                        # the CLI, launcher, benchmarks and tools
]
FLOOR = {pkg: i for i, floor in enumerate(FLOORS) for pkg in floor}
OURS = set(FLOOR)

# Torch-free: the gateway starts fast and scales out cheaply; the cluster floor is shared by it.
TORCH_FREE = {"proto", "cluster", "gateway"}
TORCH = {"torch", "transformers", "safetensors", "triton", "numpy", "xgrammar", "nixl"}
# The compute floors never talk to the network or the deployment's services.
NO_NETWORK = {"engine", "pdkernels"}
NETWORK = {"grpc", "grpc_health", "redis", "fastapi", "uvicorn", "prometheus_client", "httpx"}

# The torch-free engine modules the gateway and the Redis directory share (ARCHITECTURE.md):
# the block hash, and the ranges of the sampling parameters.
SHARED = {"engine.block_hash", "engine.sampling_limits"}


def _sources(package: str):
    for f in sorted((ROOT / package).rglob("*.py")):
        if not f.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            yield f


def _imported_names(tree: ast.AST, package: str) -> set[str]:
    """Dotted names a module imports, relative imports resolved against its package."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names |= {f"{base}.{a.name}" for a in node.names}
    return names


def imports_of(package: str) -> dict[str, set[str]]:
    """file -> the top-level packages it imports (SHARED modules left out)."""
    out = {}
    for f in _sources(package):
        mod = ".".join(f.relative_to(ROOT).with_suffix("").parts)
        pkg = mod.removesuffix(".__init__") if f.name == "__init__.py" else mod.rpartition(".")[0]
        names = _imported_names(ast.parse(f.read_text()), pkg)
        out[str(f.relative_to(ROOT))] = {n.split(".")[0] for n in names
                                         if n and n not in SHARED and not n.startswith(
                                             tuple(s + "." for s in SHARED))}
    return out


def _forbidden(package: str) -> set[str]:
    bad = {p for p in OURS if p != package and FLOOR[p] >= FLOOR[package]}
    if package in TORCH_FREE:
        bad |= TORCH | (OURS - TORCH_FREE)
    if package in NO_NETWORK:
        bad |= NETWORK
    if package == "engine":
        bad.add("proto")                 # the engine knows no wire format
    return bad


@pytest.mark.parametrize("package", sorted(OURS))
def test_imports_point_down(package):
    forbidden = _forbidden(package)
    bad = {f: sorted(m & forbidden) for f, m in imports_of(package).items() if m & forbidden}
    assert not bad, f"{package} imports what it must not (ARCHITECTURE.md, floors): {bad}"


def test_every_package_has_a_floor():
    pkgs = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert pkgs == OURS, f"packages without a floor here or missing: {pkgs ^ OURS}"


def _module_graph() -> dict[str, set[str]]:
    files = {}
    for package in sorted(OURS):
        for f in _sources(package):
            mod = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            files[mod.removesuffix(".__init__")] = f

    def ours(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, f in files.items():
        pkg = mod if f.name == "__init__.py" else mod.rpartition(".")[0]
        deps = {ours(n) for n in _imported_names(ast.parse(f.read_text()), pkg)}
        graph[mod] = {d for d in deps if d and d != mod}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    found = circles(_module_graph())
    assert not found, f"import circles (break each by moving the shared piece down): {found}"


@pytest.mark.parametrize("module", sorted(SHARED))
def test_shared_modules_are_standard_library_only(module):
    mods: set[str] = set()
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module.split(".")[0])
    assert mods <= set(sys.stdlib_module_names) | {"__future__"}, mods


def test_gateway_starts_without_torch():
    code = ("import sys, gateway.server, pdserve.cli, cluster.registry, cluster.metrics; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
            "or m.startswith('engine.') and m not in %r]; "
            "assert not bad, bad" % (SHARED,))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_no_package_of_ours_shares_its_name_with_an_installed_distribution():
    """A top-level package of ours named like another distribution's module shadows it from the
    checkout (transformers >= 5.25 imports PyPI's `kernels`, which a `kernels/` of ours hid)."""
    from importlib.metadata import packages_distributions

    owners = packages_distributions()
    clash = {p: sorted(set(owners.get(p, ())) - {"pdserve"}) for p in sorted(OURS)}
    assert not {p: d for p, d in clash.items() if d}, clash


def test_transformers_layers_import_from_the_checkout():
    """Run from the checkout (its root first on sys.path, as under pytest and `python -m`),
    transformers' layers import installed modules only: none that they bring in is a file of
    the checkout outside the environment (they imported a `kernels/` of ours as PyPI's
    `kernels`)."""
    code = ("import os, sys, pathlib, pdkernels; "
            "root, env = pathlib.Path.cwd().resolve(), pathlib.Path(sys.prefix).resolve(); "
            "before = set(sys.modules); "
            "import transformers.activations, transformers.models.llama.modeling_llama; "
            "new = {m: getattr(sys.modules[m], '__file__', None) or '' "
            "for m in set(sys.modules) - before}; "
            "dirs = {m: pathlib.Path(f).resolve().parents for m, f in new.items() "
            "if os.path.isabs(f)}; "
            "ours = sorted(m for m, d in dirs.items() if root in d and env not in d); "
            "assert not ours, f'transformers imported modules of the checkout: {ours}'")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]


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
