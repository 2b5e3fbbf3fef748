"""The restart policy: which segment a configuration opens (open_store). A
configuration decision, kept apart from the store's mechanics: with no
explicit capacity an existing segment is used as it is (chunks survive
restarts); with one, a stale segment of other settings is re-created and a
live one attached as it is, with a warning."""

from __future__ import annotations

import logging
from typing import Any

from shmkv.errors import SegmentCorruptError, SegmentExistsError, SegmentMismatchError, SegmentNotFoundError
from shmkv.store.results import OpenOutcome
from shmkv.store.store import SegmentGeometry, Store
from shmkv.units import format_bytes

log = logging.getLogger("shmkv.store")

_GEOMETRY_FIELDS = ("capacity_bytes", "arena_bytes", "max_payload_bytes", "max_entries")


def open_store(cfg: Any, *, populate: bool | None = None) -> Store:
    """The configured segment (a ShmkvConfig), attached or created.
    `populate` overrides cfg.populate (a process that copies few payloads,
    like vLLM's scheduler, need not map the whole arena up front).

    With no explicit `capacity` (cfg.capacity == 0), a segment of that name
    that exists, live or stale, is used as it is, whatever its size: chunks
    survive restarts and every process agrees. Only when there is none (or it
    is unusable and nobody is attached) one is created with
    shmkv.config.default_capacity(), which depends on /dev/shm's size, never
    on what is free in it.

    With an explicit capacity: a live segment of another geometry (another
    instance's or the daemon's settings) is attached as it is, with a warning;
    a stale one is re-created with the explicit settings, and the log says how
    many chunks that dropped."""
    from shmkv.config import default_capacity

    populate = cfg.populate if populate is None else populate
    name, kw = cfg.cache_name, {"populate": populate, "lock_timeout_s": cfg.lock_timeout,
                                "segment_dir": cfg.segment_dir}
    if not cfg.capacity:
        try:
            store = Store.attach(name, **kw)
        except (SegmentNotFoundError, SegmentMismatchError, SegmentCorruptError) as e:
            capacity = default_capacity(cfg.segment_dir)
            if not isinstance(e, SegmentNotFoundError):
                log.warning("shmkv: segment '%s' is not usable (%s); re-creating it unless a process uses it",
                            name, str(e).replace("\n", ";"))
            log.info("shmkv: creating segment '%s' with the default capacity %s (a quarter of /dev/shm's size, "
                     "within 256 MiB..16 GiB; set `capacity` to choose)", name, format_bytes(capacity))
            store = Store.open_or_create(name, capacity, max_payload_bytes=cfg.max_payload, **kw)
    else:
        store = _open_explicit(cfg, kw)
    st = store.stats()
    log.info("shmkv: %s segment '%s' (capacity %.1f GiB, max chunk %.1f MiB, %d processes attached)",
             store.outcome.name.lower().replace("_", " "), cfg.cache_name, st["capacity_bytes"] / 2**30,
             st["max_payload_bytes"] / 2**20, st["processes_attached"])
    return store


def _open_explicit(cfg: Any, kw: dict[str, Any]) -> Store:
    name = cfg.cache_name
    want = SegmentGeometry(cfg.capacity, cfg.max_payload).resolved()
    try:
        probe: Store | None = Store.attach(name, populate=False, lock_timeout_s=kw["lock_timeout_s"],
                                             background_reserve=False, segment_dir=kw["segment_dir"])
    except (SegmentNotFoundError, SegmentMismatchError, SegmentCorruptError):
        probe = None  # none, or one open_or_create re-creates (stale) or refuses (live)
    if probe is not None:
        st, outcome = probe.stats(), probe.outcome
        probe.close()
        del probe
        diff = [f"{k} {st[k]} (asked {want[k]})" for k in _GEOMETRY_FIELDS if st[k] != want[k]]
        if diff and outcome is OpenOutcome.ATTACHED:
            log.warning("shmkv: segment '%s' is in use with other settings (%s); attaching it as it is",
                        name, ", ".join(diff))
            return Store.attach(name, **kw)
        if diff:
            try:
                store = Store.create(name, cfg.capacity, max_payload_bytes=cfg.max_payload, **kw)
            except SegmentExistsError:  # a process attached it meanwhile: use it as it is
                return Store.attach(name, **kw)
            log.warning("shmkv: re-created stale segment '%s' with the configured settings: %d chunks dropped "
                        "(it had %s)", name, st["ready_entries"], ", ".join(diff))
            return store
    try:
        return Store.open_or_create(name, cfg.capacity, max_payload_bytes=cfg.max_payload, **kw)
    except SegmentMismatchError as e:  # created by someone else in between
        log.warning("shmkv: segment '%s' exists with other settings; attaching it as it is (%s)",
                    name, str(e).replace("\n", ";"))
        return Store.attach(name, **kw)
