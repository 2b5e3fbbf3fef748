"""Which namespaces a cache holds chunks of, so an operator can name one.

A chunk key chains from its namespace's root key (shmkv.keys), so the
controller needs the namespace to look up, pin or move token ids. The
connector registers the namespaces its engine uses (without a cache salt) in

    <runtime dir>/<cache>.namespaces.jsonl     0600, one JSON object per line

{"root": <32 hex>, "namespace": {...fields...}}, appended with O_APPEND (one
line is one write(2), which the kernel does not interleave). `GET /namespaces`
lists them; a request may then name a namespace by its root hex.

Salted namespaces are never written: a tenant's cache salt is its secret.
A tenant's chunks are still tagged with their (salted) root, and a request
may give the namespace as an object with its `cache_salt`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from shmkv.errors import ConfigError
from shmkv.keys import Namespace
from shmkv.paths import runtime_dir

log = logging.getLogger("shmkv.namespaces")


def _registry_name(cache_name: str) -> str:
    return f"{cache_name}.namespaces.jsonl"


def registry_path(cache_name: str) -> str:
    return runtime_dir().join(_registry_name(cache_name))


def register(cache_name: str, ns: Namespace) -> str:
    """Record an unsalted namespace (idempotent); returns its root hex."""
    root = ns.root_key().hex()
    if ns.cache_salt is not None:
        return root
    try:
        if root in known(cache_name):
            return root
        line = json.dumps({"root": root, "namespace": namespace_to_dict(ns)}, sort_keys=True) + "\n"
        fd = runtime_dir().open(_registry_name(cache_name), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError as e:
        log.warning("shmkv: cannot record namespace %s in %s: %s", root, registry_path(cache_name), e)
    return root


def known(cache_name: str) -> dict[str, dict[str, Any]]:
    """root hex -> namespace fields, for every namespace registered."""
    out: dict[str, dict[str, Any]] = {}
    try:
        fd = runtime_dir().open(_registry_name(cache_name), os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    out[str(rec["root"])] = dict(rec["namespace"])
                except (ValueError, KeyError, TypeError):
                    continue  # a torn or foreign line: skip it
    except FileNotFoundError:
        pass
    return out


def namespace_to_dict(ns: Namespace) -> dict[str, Any]:
    d = dataclasses.asdict(ns)
    d["extra"] = [list(p) for p in ns.extra]
    return d


def namespace_from_dict(d: dict[str, Any]) -> Namespace:
    """A Namespace from its fields; ConfigError naming what is wrong."""
    if not isinstance(d, dict):
        raise ConfigError(f"namespace must be an object of fields, got {type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(Namespace)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ConfigError(f"namespace: unknown field(s) {unknown}; known: {', '.join(sorted(fields))}")
    required = [n for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in d]
    if missing:
        raise ConfigError(f"namespace: missing field(s) {missing}")
    kwargs: dict[str, Any] = {}
    for name, value in d.items():
        if name == "extra":
            try:
                kwargs[name] = tuple((str(a), str(b)) for a, b in value)
            except (TypeError, ValueError) as e:
                raise ConfigError("namespace.extra: expected a list of [key, value] pairs") from e
            continue
        want = {"model_id": str, "dtype": str, "payload": str, "attention_layout": str, "isa": str,
                "mla": bool}.get(name, int)
        if name == "cache_salt":
            if value is not None and not isinstance(value, str):
                raise ConfigError("namespace.cache_salt: expected a string or null")
        elif want is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"namespace.{name}={value!r}: expected an integer")
        elif want is not int and not isinstance(value, want):
            raise ConfigError(f"namespace.{name}={value!r}: expected a {want.__name__}")
        kwargs[name] = value
    return Namespace(**kwargs)
