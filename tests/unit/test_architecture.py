"""The package's architecture, checked on its source: the tier chain
(shmkv/tiers/chain.py) is the only code that moves chunks between tiers
(benchmarks aside: they time one tier's own writes) and, with open_tiers,
the only place tiers are built (benchmarks included); no tier imports
another tier; no layer imports one above it (store < tiers < transfer <
services < integrations)."""

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


SERVICES_AND_UP = ("shmkv.integration", "shmkv.services", "shmkv.daemon", "shmkv.stats", "shmkv.bench", "shmkv.cli")


@pytest.mark.parametrize("layer,above", [
    ("shmkv.store", SERVICES_AND_UP + ("shmkv.tiers", "shmkv.transfer")),
    ("shmkv.tiers", SERVICES_AND_UP + ("shmkv.transfer",)),
    ("shmkv.transfer", SERVICES_AND_UP + ("shmkv.tiers.chain", "shmkv.tiers.disk", "shmkv.tiers.remote")),
    ("shmkv.services", ("shmkv.integration", "shmkv.bench", "shmkv.cli", "shmkv.transfer")),
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
