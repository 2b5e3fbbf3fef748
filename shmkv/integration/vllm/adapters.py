"""Which LoRA adapter a worker computes with, so that a request's keys name
the adapter tensors its KV was computed with, never the adapter directory as
it happens to be when the request arrives.

vLLM loads an adapter once per `lora_int_id` and keeps serving those tensors
while its directory is rewritten; it reloads from disk only after evicting
the adapter (its LRU of `max_cpu_loras`) or for a `load_inplace` request.
So:

  * Each worker digests the adapter directory around vLLM's own read
    (WorkerLoRAManager._load_adapter, hooked once vLLM's module is
    imported): the files' digest before the read, their (device, inode,
    size, mtime, ctime) before and after. Files that moved during the read
    give a digest that matches nothing ("unsettled:..."): the adapter's
    requests are neither loaded nor stored until vLLM loads it again.
  * The worker keeps that digest beside the LoRAModel it returned, so "what
    this rank holds under id X" is read from vLLM's own adapter cache (an
    evicted adapter is gone from it), and publishes the map on its weights
    board (weights.py).
  * The scheduler half keys a request by the digest every rank reports for
    its lora_int_id; for an id no rank holds, by the directory's digest now
    (the workers load it at the request's first step); where neither is
    known (a hub id not yet downloaded) it neither looks up nor stores.
  * The step's metadata carries each request's expected digest; a rank that
    holds another (evicted and reloaded from changed files, or changed while
    being read) refuses the request's loads and every rank stores nothing
    of it (rank_failures.py).

Invariant: a chunk stored under an adapter digest was computed by ranks that
held, at every step of the request, the adapter read from files of that
digest.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import xxhash

log = logging.getLogger("shmkv.connector")

_HOOKED = "_shmkv_adapter_hook"
MAX_REMEMBERED = 1024  # directory digests kept in memory, by the files' stats

_digests: dict[tuple, str] = {}
_digests_lock = threading.Lock()
_held: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # LoRAModel -> digest of what it was read from
_managers: weakref.WeakSet[Any] = weakref.WeakSet()  # this process's WorkerLoRAManagers that loaded an adapter
_tracking = False  # a shmkv worker lives in this process (track()): only then is vLLM's read digested


def track() -> None:
    """A shmkv worker of this process serves LoRA: digest each adapter vLLM loads from now on."""
    global _tracking
    _tracking = True


def _local_dir(path: str) -> str | None:
    """The adapter's local directory (vLLM's rules for a local path), or None
    for what is not one (a hub id: vLLM downloads it on the worker)."""
    if not path:
        return None
    p = os.path.abspath(os.path.expanduser(path))
    return p if os.path.isdir(p) else None


def _stats(path: str) -> tuple[str, tuple] | None:
    """(the directory, its regular files' names and stats), or None."""
    d = _local_dir(path)
    if d is None:
        return None
    try:
        names = sorted(n for n in os.listdir(d) if os.path.isfile(os.path.join(d, n)))
        return d, tuple((n, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                        for n in names for st in [os.stat(os.path.join(d, n))])
    except OSError:
        return None


def directory_digest(path: str) -> str | None:
    """xxh3-128 over the adapter directory's regular files (names and bytes),
    remembered by their stats; None where `path` is no readable directory."""
    st = _stats(path)
    if st is None:
        return None
    with _digests_lock:
        got = _digests.get(st)
    if got is not None:
        return got
    d, files = st
    h = xxhash.xxh3_128()
    try:
        for name, *_ in files:
            h.update(name.encode() + b"\x00")
            with open(os.path.join(d, name), "rb") as f:
                for block in iter(lambda f=f: f.read(1 << 20), b""):
                    h.update(block)
    except OSError:
        return None
    digest = h.hexdigest()
    with _digests_lock:
        if len(_digests) >= MAX_REMEMBERED:
            _digests.pop(next(iter(_digests)))
        _digests[st] = digest
    return digest


def usable(digest: str) -> bool:
    """Whether a held adapter's digest can key chunks (not one of a read
    that saw its files move, nor an id two managers of a process disagree on)."""
    return bool(digest) and not digest.startswith(("unsettled:", "ambiguous:"))


def _digest_around(path: str, load: Callable[[], Any]) -> tuple[Any, str]:
    """Run vLLM's read of the adapter at `path` and say what it read: the
    directory's digest if its files did not move meanwhile."""
    before = _stats(path)
    digest = directory_digest(path) if before is not None else None
    loaded = load()
    after = _stats(path)
    if digest is None or before != after:
        digest = f"unsettled:{uuid.uuid4().hex}"
        log.warning("shmkv: LoRA adapter %r %s while vLLM read it: its requests are neither loaded from nor stored "
                    "in the shared cache until vLLM loads it again", path,
                    "changed" if before is not None else "is not a local directory shmkv can read")
    return loaded, digest


def install_adapter_hook(module: Any = None) -> bool:
    """Wrap vLLM's WorkerLoRAManager._load_adapter (idempotent)."""
    try:
        if module is None:
            import vllm.lora.worker_manager as module
        cls = module.WorkerLoRAManager
    except Exception as e:  # noqa: BLE001 - another vLLM: adapters are then keyed by their files at lookup
        log.debug("shmkv: vLLM's LoRA loader could not be hooked: %s", e)
        return False
    original = cls._load_adapter
    if getattr(original, _HOOKED, False):
        return True

    def _load_adapter(self: Any, lora_request: Any) -> Any:
        if not _tracking:
            return original(self, lora_request)
        path = str(getattr(lora_request, "lora_path", "") or "")
        if path and _local_dir(path) is None:
            try:  # a hub id: the snapshot vLLM resolves (and downloads) is what it reads
                from vllm.lora.utils import get_adapter_absolute_path

                path = get_adapter_absolute_path(path)
            except Exception:  # noqa: BLE001 - vLLM's own call below raises what it should
                pass
        lora, digest = _digest_around(path, lambda: original(self, lora_request))
        try:
            _held[lora] = digest
            _managers.add(self)
        except TypeError:  # not weak-referenceable (another vLLM): nothing is held, nothing matches
            log.warning("shmkv: cannot note which LoRA adapter vLLM loaded: requests with adapters are served "
                        "without the shared cache")
        return lora

    setattr(_load_adapter, _HOOKED, True)
    _load_adapter.__wrapped__ = original  # type: ignore[attr-defined]
    cls._load_adapter = _load_adapter
    return True


def _model_managers(models: Iterable[Any]) -> list[Any]:
    """The LoRA managers serving `models` (the connector's, found from its
    KV-cache layers); all of this process's where none matches by identity."""
    managers = list(_managers)
    ids = {id(m) for m in models}
    mine = [m for m in managers if id(getattr(getattr(m, "_adapter_manager", None), "model", None)) in ids]
    return mine or managers


def held_adapters(models: Iterable[Any]) -> dict[int, str]:
    """lora_int_id -> digest of the adapter this rank holds under it now
    ("" for one loaded without the hook: a warm-up dummy)."""
    out: dict[int, str] = {}
    for m in _model_managers(models):
        try:
            adapters = m._adapter_manager.list_adapters()
        except Exception:  # noqa: BLE001 - another vLLM's manager: nothing known is held
            continue
        for aid, lora in adapters.items():
            digest = _held.get(lora, "")
            if out.get(int(aid), digest) != digest:
                digest = f"ambiguous:{aid}"  # two managers of this process hold other adapters under one id
            out[int(aid)] = digest
    return out
