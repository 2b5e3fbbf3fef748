"""Does shmkv's vLLM integration fit a vLLM source tree? Read, never
imported: a wheel of another platform (vLLM for CUDA, here on a CPU host) or
a release not installed can be checked from its Python sources alone.

What it checks, for every module of shmkv that imports vLLM:
  * each `from vllm... import Name` resolves (the module exists and defines,
    re-exports or lazily exports Name);
  * each method a class overrides from a vLLM base exists in that base's
    chain with a signature vLLM's calls still fit: every parameter the base
    declares is accepted by name and at the same position, a parameter the
    base lacks has a default, classmethods stay classmethods; every abstract
    method of the chain is implemented;
  * each `Name.attr` of an imported vLLM class (a factory's registry, its
    register call) is defined in its chain;
  * each call `Name(...)` of an imported vLLM class passes fields or
    parameters it has.
What it cannot see: attributes read from the objects vLLM passes in
(request.prompt_token_ids, ...); the end-to-end tests run those.

    python tools/vllm_interface_check.py DIR    (DIR holds vllm/)
    python tools/vllm_interface_check.py --wheel vllm==0.33.0

A maintainer's tool (it downloads a wheel): not part of the package.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field


def _package_dir() -> str:
    """shmkv/'s directory, found without importing it (its sources are read, not run)."""
    spec = importlib.util.find_spec("shmkv")
    if spec is None or not spec.origin:
        raise ModuleNotFoundError("shmkv is not installed: pip install -e . first")
    # NOTE: the directory of its __init__.py: an editable install also lists the build's directory
    # (the compiled modules, no sources) among the package's search locations
    return os.path.dirname(spec.origin)



@dataclass
class _Class:
    module: str
    node: ast.ClassDef
    bases: list[_Class] = field(default_factory=list)


class VllmTree:
    """A vLLM source tree (the directory that holds vllm/), parsed on demand."""

    def __init__(self, root: str) -> None:
        self.root = root
        if not os.path.isfile(os.path.join(root, "vllm", "__init__.py")):
            raise FileNotFoundError(f"{root}: no vllm/__init__.py (give the directory that holds vllm/)")
        self._modules: dict[str, ast.Module | None] = {}

    def module(self, name: str) -> ast.Module | None:
        if name not in self._modules:
            rel = name.replace(".", os.sep)
            for path in (os.path.join(self.root, rel + ".py"), os.path.join(self.root, rel, "__init__.py")):
                if os.path.isfile(path):
                    with open(path, encoding="utf-8") as f:
                        self._modules[name] = ast.parse(f.read(), path)
                    break
            else:
                self._modules[name] = None
        return self._modules[name]

    def is_package(self, name: str) -> bool:
        return os.path.isfile(os.path.join(self.root, name.replace(".", os.sep), "__init__.py"))

    def lookup(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """(defining module, node) of `name` as `module` exports it; a
        submodule is (its name, its Module); None if it exports no such name."""
        tree = self.module(module)
        if tree is None or depth > 8:
            return None
        lazy = False
        for node in _flat(tree.body):
            found = _defines(node, name)
            if found is not None:
                return module, found
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if (a.asname or a.name) == name:
                        src = _absolute(module, node, self.is_package(module))
                        return self.lookup(src, a.name, depth + 1) or self._submodule(f"{src}.{a.name}")
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                lazy = True
        sub = self._submodule(f"{module}.{name}")
        if sub is not None:
            return sub
        if lazy and any(isinstance(n, ast.Constant) and n.value == name for n in ast.walk(tree)):
            return module, ast.Constant(value=name)  # exported lazily (a module __getattr__ names it)
        return None

    def _submodule(self, name: str) -> tuple[str, ast.AST] | None:
        tree = self.module(name)
        return (name, tree) if tree is not None else None

    def klass(self, module: str, name: str, depth: int = 0) -> _Class | None:
        """The class `name` of `module`, with its vLLM bases (others are left out)."""
        found = self.lookup(module, name)
        if found is None or not isinstance(found[1], ast.ClassDef) or depth > 16:
            return None
        mod, node = found
        out = _Class(mod, node)
        for b in node.bases:
            b = b.value if isinstance(b, ast.Subscript) else b  # Generic[T], Base[T]
            if isinstance(b, ast.Name):
                base = self.klass(mod, b.id, depth + 1)
                if base is not None:
                    out.bases.append(base)
        return out


def _flat(body: list[ast.stmt]) -> list[ast.stmt]:
    """A module's statements, those of its top-level if/try blocks (TYPE_CHECKING, fallbacks) included."""
    out = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If):
            out += _flat(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            out += _flat(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])
    return out


def _defines(node: ast.stmt, name: str) -> ast.AST | None:
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
        return node
    if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
        return node
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
        return node
    if isinstance(node, ast.Import):
        for a in node.names:
            if (a.asname or a.name.split(".")[0]) == name:
                return node
    return None


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    base = ".".join(parts[:keep])
    return f"{base}.{node.module}" if node.module else base


def _chain(c: _Class) -> list[_Class]:
    """The class and its vLLM bases, nearest first (a depth-first MRO is enough here)."""
    out, todo = [], [c]
    while todo:
        k = todo.pop(0)
        if all(k.node is not o.node for o in out):
            out.append(k)
            todo.extend(k.bases)
    return out


def _methods(c: _Class) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    out: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
    for k in reversed(_chain(c)):
        for node in k.node.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[node.name] = node
    return out


def _decorators(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    out = set()
    for d in fn.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        out.add(d.attr if isinstance(d, ast.Attribute) else d.id if isinstance(d, ast.Name) else "")
    return out


def _attributes(c: _Class) -> set[str]:
    """Every name the chain defines: methods, class attributes, fields, self.X."""
    out = set(_methods(c))
    for k in _chain(c):
        for node in ast.walk(k.node):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out.add(node.target.id)
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        out.add(t.id)
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        out.add(t.attr)
    return out


def _fields(c: _Class) -> list[str] | None:
    """The names a call of the class accepts (its __init__'s, or its fields'
    for a dataclass / msgspec struct / NamedTuple); None: it accepts any."""
    if any("Enum" in ast.unparse(b) for k in _chain(c) for b in k.node.bases):
        return None  # an enum: called with a value
    init = _methods(c).get("__init__")
    if init is not None:
        a = init.args
        if a.kwarg is not None or a.vararg is not None:
            return None
        return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs][1:]
    names: list[str] = []
    for k in reversed(_chain(c)):
        for node in k.node.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                    "ClassVar" not in ast.unparse(node.annotation):
                names.append(node.target.id)
    return names


def signature_problems(name: str, ours: ast.FunctionDef | ast.AsyncFunctionDef,
                       theirs: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Why a call vLLM makes to `theirs` would not fit `ours` (empty: it fits)."""
    out = []
    kinds_o, kinds_t = _decorators(ours), _decorators(theirs)
    for kind in ("classmethod", "staticmethod", "property"):
        if (kind in kinds_t) != (kind in kinds_o):
            out.append(f"{name}: vLLM's is {'a ' + kind if kind in kinds_t else 'not a ' + kind}, ours "
                       f"{'is' if kind in kinds_o else 'is not'}")
    o, t = ours.args, theirs.args
    skip = 0 if "staticmethod" in kinds_t else 1  # self / cls
    o_pos = [x.arg for x in o.posonlyargs + o.args][skip:]
    t_pos = [x.arg for x in t.posonlyargs + t.args][skip:]
    o_kwonly = {x.arg for x in o.kwonlyargs}
    for i, p in enumerate(t_pos):
        if i < len(o_pos):
            if o_pos[i] != p:
                out.append(f"{name}: vLLM passes `{p}` as parameter {i + 1}; ours names it `{o_pos[i]}`")
        elif o.vararg is None or (o.kwarg is None and p not in o_kwonly):
            out.append(f"{name}: vLLM declares parameter `{p}`, which ours does not take")
    for x in t.kwonlyargs:
        if x.arg not in o_kwonly and x.arg not in o_pos and o.kwarg is None:
            out.append(f"{name}: vLLM declares keyword `{x.arg}`, which ours does not take")
    o_defaults = len(o.defaults)
    for i, p in enumerate(o_pos):
        if i >= len(t_pos) and i < len(o_pos) - o_defaults:
            out.append(f"{name}: ours requires `{p}`, which vLLM's does not declare (vLLM would not pass it)")
    for x, d in zip(o.kwonlyargs, o.kw_defaults):
        if d is None and x.arg not in {y.arg for y in t.kwonlyargs}:
            out.append(f"{name}: ours requires keyword `{x.arg}`, which vLLM's does not declare")
    if t.vararg is not None and o.vararg is None:
        out.append(f"{name}: vLLM's takes *{t.vararg.arg}; ours takes no extra positional arguments")
    if t.kwarg is not None and o.kwarg is None:
        out.append(f"{name}: vLLM's takes **{t.kwarg.arg}; ours takes no extra keywords")
    return out


def _imports(tree: ast.Module) -> dict[str, tuple[str, str]]:
    """local name -> (vllm module, exported name), for every `from vllm... import` in the module."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm" \
                and not node.level:
            for a in node.names:
                out[a.asname or a.name] = (node.module, a.name)
    return out


def _sources(package: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(package) for f in files if f.endswith(".py"))


def check(vllm_root: str, package: str | None = None) -> list[str]:
    """The problems of shmkv's vLLM use (every module of `package` that
    imports vLLM; default: the installed shmkv) against the vLLM tree at `vllm_root`."""
    package = package or _package_dir()
    tree = VllmTree(vllm_root)
    problems: list[str] = []
    for path in _sources(package):
        with open(path, encoding="utf-8") as f:
            mod = ast.parse(f.read(), path)
        where = os.path.relpath(path, os.path.dirname(package))
        imports = _imports(mod)
        classes: dict[str, _Class | None] = {}
        for local, (module, name) in sorted(imports.items()):
            if tree.lookup(module, name) is None:
                problems.append(f"{where}: `from {module} import {name}`: vLLM has no such name")
            classes[local] = tree.klass(module, name)
        for node in ast.walk(mod):
            if isinstance(node, ast.ClassDef):
                problems += _check_class(where, node, classes)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and classes.get(node.value.id) is not None and isinstance(node.ctx, ast.Load):
                if node.attr not in _attributes(classes[node.value.id]):  # type: ignore[arg-type]
                    problems.append(f"{where}:{node.lineno}: `{node.value.id}.{node.attr}`: vLLM's "
                                    f"{node.value.id} has no `{node.attr}`")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and classes.get(node.func.id) is not None:
                problems += _check_call(f"{where}:{node.lineno}", node, classes[node.func.id])  # type: ignore
    return problems


def _check_class(where: str, node: ast.ClassDef, classes: dict[str, _Class | None]) -> list[str]:
    bases = [classes.get(b.id) for b in node.bases if isinstance(b, ast.Name) and b.id in classes]
    bases = [b for b in bases if b is not None]
    if not bases:
        return []
    theirs: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
    for b in reversed(bases):
        theirs.update(_methods(b))
    ours = {n.name: n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    out = []
    for name, fn in ours.items():
        if name in theirs and not name.startswith("__"):
            out += [f"{where}: {node.name}.{p}" for p in signature_problems(name, fn, theirs[name])]
    for name, fn in theirs.items():
        if "abstractmethod" in _decorators(fn) and name not in ours:
            out.append(f"{where}: {node.name} does not implement vLLM's abstract `{name}`")
    return out


def _check_call(where: str, call: ast.Call, c: _Class) -> list[str]:
    names = _fields(c)
    if names is None:
        return []
    out = [f"{where}: {c.node.name}({k.arg}=...): vLLM's {c.node.name} takes no `{k.arg}`"
           for k in call.keywords if k.arg is not None and k.arg not in names]
    if len(call.args) > len(names):
        out.append(f"{where}: {c.node.name}() given {len(call.args)} positional arguments; vLLM's takes "
                   f"{len(names)}")
    return out


def extract_wheel(wheel: str, dest: str) -> str:
    """The Python sources of a vLLM wheel, unpacked under `dest` (nothing installed)."""
    with zipfile.ZipFile(wheel) as z:
        z.extractall(dest, [n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")])
    return dest


def download_wheel(requirement: str, dest: str) -> str:
    """`pip download --no-deps` of one vLLM wheel (e.g. vllm==0.33.0) into `dest`; its path."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", dest,
                    requirement], check=True)
    wheels = [f for f in os.listdir(dest) if f.startswith("vllm-") and f.endswith(".whl")]
    if len(wheels) != 1:
        raise FileNotFoundError(f"pip download {requirement} left {wheels} in {dest}")
    return os.path.join(dest, wheels[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/vllm_interface_check.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", nargs="?", help="a directory holding vllm/ (a checkout, site-packages, an unpacked wheel)")
    ap.add_argument("--wheel", help="a requirement to pip-download (vllm==0.33.0) or a .whl file")
    args = ap.parse_args(argv)
    if bool(args.root) == bool(args.wheel):
        ap.error("give a directory or --wheel")
    with tempfile.TemporaryDirectory(prefix="shmkv-vllm-") as tmp:
        root = args.root
        if args.wheel:
            wheel = args.wheel if args.wheel.endswith(".whl") else download_wheel(args.wheel, tmp)
            root = extract_wheel(wheel, os.path.join(tmp, "src"))
        problems = check(root)
    for p in problems:
        print(p)
    print(f"{len(problems)} problems" if problems else "shmkv's vLLM integration fits this vLLM")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
