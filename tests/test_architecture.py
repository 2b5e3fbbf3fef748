"""The package's architecture, checked on its source: the tier chain
(shmkv/tiers/chain.py) is the only code that moves chunks between tiers
(benchmarks aside: they time one tier's own writes) and, with open_tiers,
the only place tiers are built (benchmarks included); no tier imports
another tier; no layer imports one above it (store < tiers < transfer <
services < integrations < engines < bench, check); the engine machinery
(shmkv.engines) never imports the measurements (shmkv.bench), and the
product's own floors never import either."""

from __future__ import annotations

import ast
import os

import pytest
from helpers import REPO

PKG = os.path.join(REPO, "shmkv")
MOVES = {"write", "write_encoded", "put_encoded", "enqueue", "flush", "sync", "spill"}  # a tier's moves
TIER_CLASSES = {"DiskTier", "RemoteTier"}
TIER_OPENERS = {"open_disk", "open_remote"}


def modules() -> dict[str, ast.Module]:
    out = {}
    for root, _dirs, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                with open(path) as fh:
                    out[rel] = ast.parse(fh.read(), path)
    return out


MODULES = modules()


def imports_of(tree: ast.Module) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in out if m.startswith("shmkv")}


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_walk_sees_the_package():
    assert {"shmkv.tiers.chain", "shmkv.tiers.disk.tier", "shmkv.tiers.remote.tier", "shmkv.store"} <= set(MODULES)


@pytest.mark.parametrize("tier,other", [("shmkv.tiers.disk", "shmkv.tiers.remote"),
                                        ("shmkv.tiers.remote", "shmkv.tiers.disk")])
def test_no_tier_imports_another_tier_or_the_chain(tier, other):
    bad = {m: sorted(i for i in imports_of(t) if in_package(i, other) or in_package(i, "shmkv.tiers.chain")
                     or in_package(i, "shmkv.store"))
           for m, t in MODULES.items() if in_package(m, tier)}
    assert not any(bad.values()), bad


SERVICES_AND_UP = ("shmkv.integration", "shmkv.services", "shmkv.daemon", "shmkv.stats", "shmkv.engines",
                   "shmkv.bench", "shmkv.check", "shmkv.cli")


@pytest.mark.parametrize("layer,above", [
    ("shmkv.store", SERVICES_AND_UP + ("shmkv.tiers", "shmkv.transfer")),
    ("shmkv.tiers", SERVICES_AND_UP + ("shmkv.transfer",)),
    ("shmkv.transfer", SERVICES_AND_UP + ("shmkv.tiers.chain", "shmkv.tiers.disk", "shmkv.tiers.remote")),
    ("shmkv.services", ("shmkv.integration", "shmkv.engines", "shmkv.bench", "shmkv.check", "shmkv.cli",
                        "shmkv.transfer")),
    ("shmkv.integration", ("shmkv.engines", "shmkv.bench", "shmkv.check", "shmkv.cli")),
    ("shmkv.engines", ("shmkv.bench", "shmkv.check", "shmkv.cli")),
    ("shmkv.bench", ("shmkv.check",)),
])
def test_no_layer_imports_one_above_it(layer, above):
    bad = {m: sorted(i for i in imports_of(t) if any(in_package(i, a) for a in above))
           for m, t in MODULES.items() if in_package(m, layer)}
    assert not any(bad.values()), bad


def outside_the_tiers() -> dict[str, ast.Module]:
    return {m: t for m, t in MODULES.items() if not in_package(m, "shmkv.tiers") and not in_package(m, "shmkv.bench")}


def test_no_module_outside_the_chain_moves_chunks_between_tiers():
    """A call like `self.disk.write(...)` or `remote.enqueue(...)`: a tier's
    move made by someone else than the chain."""
    found = []
    for m, tree in outside_the_tiers().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MOVES:
                receiver = ast.unparse(node.func.value)
                if "disk" in receiver or "remote" in receiver:
                    found.append(f"{m}:{node.lineno}: {ast.unparse(node.func)}")
    assert not found, found


def test_tiers_are_built_only_by_open_tiers():
    found = []
    for m, tree in MODULES.items():
        if in_package(m, "shmkv.tiers"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name in TIER_CLASSES | TIER_OPENERS | {"TierChain"}:
                    found.append(f"{m}:{node.lineno}: {name}")
    assert not found, found
    def calls_open_tiers(tree: ast.Module) -> bool:
        return any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", "")) == "open_tiers"
                   for n in ast.walk(tree))

    callers = sorted(m for m, tree in outside_the_tiers().items() if calls_open_tiers(tree))
    assert callers == ["shmkv.integration.vllm.native_tier", "shmkv.integration.vllm.scheduler",
                       "shmkv.integration.vllm.worker", "shmkv.services.controller", "shmkv.services.daemon"]
    assert all(calls_open_tiers(MODULES[f"shmkv.bench.{b}"]) for b in ("disk_bench", "remote_bench", "ttft_bench"))


def test_the_chain_computes_no_key():
    """The lookup gets the keys from the caller's chunker; the chain only answers which are held."""
    assert not {i for i in imports_of(MODULES["shmkv.tiers.chain"]) if in_package(i, "shmkv.keys")}
    assert imports_of(MODULES["shmkv.tiers.chain"]) & {"shmkv.chunking.Chunker"} == set()


# ------------------------------------------------- what the package is for ---
def module_of(name: str) -> str | None:
    """The package's module an imported dotted name lands in: the longest
    prefix that is a module (`shmkv.transfer.layout.KVLayout` -> its module)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in MODULES:
            return ".".join(parts[:n])
    return None


def references(tree: ast.Module) -> set[str]:
    """The package's modules a module imports (anywhere: lazily too) or names
    in a string (a `python -m` argv, a registry of benchmark modules)."""
    names = set(imports_of(tree))
    names |= {n.value for n in ast.walk(tree)
              if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("shmkv.")}
    return {m for m in map(module_of, names) if m is not None}


PYTHON_M = {"shmkv.stats", "shmkv.daemon"}  # the `python -m` commands README and the design name


def entry_points() -> set[str]:
    """What a user runs or vLLM loads: pyproject's scripts and entry points
    (shmkv, the vLLM plugin), the package itself, `python -m shmkv` and the
    documented `python -m` commands."""
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    targets = list(project["scripts"].values())
    targets += [t for group in project["entry-points"].values() for t in group.values()]
    return ({module_of(t.split(":")[0]) for t in targets} | {"shmkv", "shmkv.__main__"} | PYTHON_M) - {None}


def test_every_module_of_the_package_serves_its_users_not_only_its_tests():
    """A module nothing reaches from an entry point (imports, `python -m`
    names) is test tooling: it belongs in tests/support/ or tools/."""
    graph = {m: references(t) for m, t in MODULES.items()}
    roots = entry_points()
    assert roots >= {"shmkv.cli", "shmkv.integration.vllm"}, roots
    seen, todo = set(roots), list(roots)
    while todo:
        for m in graph[todo.pop()]:
            if m not in seen:
                seen.add(m)
                todo.append(m)
        # a module's packages run first (their __init__)
        for m in list(seen):
            parts = m.split(".")
            for n in range(1, len(parts)):
                p = ".".join(parts[:n])
                if p in MODULES and p not in seen:
                    seen.add(p)
                    todo.append(p)
    assert sorted(set(MODULES) - seen) == []


def test_the_package_has_no_import_circle():
    """Module A imports B (at import time or lazily) and B imports A: a
    design knot (the fork server and the engines were one). A package's
    __init__ re-exporting its modules is no circle."""
    graph = {m: {r for r in imports_of_modules(t) if r != m} for m, t in MODULES.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert circles == []


def imports_of_modules(tree: ast.Module) -> set[str]:
    """The package's modules a module imports: `from P import name` is module
    P.name where that is one (`from shmkv import chunking`), else P's
    __init__; the compiled extensions (`from shmkv import _C`) are leaves."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(module_of(a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else module_of(node.module)
                       for a in node.names if not (node.module == "shmkv" and a.name.startswith("_C")))
    return {m for m in out if m is not None and m.startswith("shmkv")}


def test_test_only_behaviour_is_switched_by_the_environment_in_one_module():
    """No operator setting exists for a test's sake: nothing in the package
    says TEST ONLY, and only shmkv/testing.py reads a SHMKV_TEST_* variable."""
    said, read = [], []
    for root, _dirs, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                text = open(path).read()
                if "TEST ONLY" in text:
                    said.append(os.path.relpath(path, REPO))
                if "SHMKV_TEST_" in text and path != os.path.join(PKG, "testing.py"):
                    read.append(os.path.relpath(path, REPO))
    assert said == [] and read == [], (said, read)
