"""Segment lifecycle: create / attach / open-or-create, stale segments,
permissions, refusal of mismatched segments, /dev/shm too small."""

from __future__ import annotations

import hashlib
import os
import stat

import pytest
from helpers import key, payload_for

from shmkv import Store
from shmkv.errors import (
    InvalidArgumentError,
    NoSpaceError,
    PermissionDeniedError,
    SegmentExistsError,
    SegmentMismatchError,
    SegmentNotFoundError,
)
from shmkv.store import OpenOutcome

MiB = 1 << 20


def shm_digest(name: str) -> str:
    with open(f"/dev/shm/{name}", "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_created_0600_exactly_capacity_whatever_the_umask(cache_name):
    old = os.umask(0)
    try:
        s = Store.create(cache_name, 3 * MiB)
    finally:
        os.umask(old)
    st = os.stat(f"/dev/shm/{cache_name}")
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_size == 3 * MiB
    assert st.st_blocks * 512 >= 3 * MiB, "pages are reserved up front (posix_fallocate)"
    s.close()


def test_attach_sees_the_same_chunks(cache_name):
    a = Store.create(cache_name, 4 * MiB)
    a.put(key(1), payload_for(key(1), 1000))
    b = Store.attach(cache_name)
    assert b.outcome is OpenOutcome.ATTACHED
    assert b.get(key(1)) == payload_for(key(1), 1000)
    c = Store.open_or_create(cache_name, 4 * MiB)
    assert c.outcome is OpenOutcome.ATTACHED
    for s in (a, b, c):
        s.close()


def test_attach_missing_segment_names_it(cache_name):
    with pytest.raises(SegmentNotFoundError, match=cache_name):
        Store.attach(cache_name)


def test_create_refuses_a_live_segment(cache_name):
    a = Store.create(cache_name, 2 * MiB)
    with pytest.raises(SegmentExistsError, match="live processes"):
        Store.create(cache_name, 2 * MiB)
    a.close()


def test_mismatched_configuration_is_refused_and_untouched(cache_name):
    a = Store.create(cache_name, 4 * MiB, alignment=256)
    a.put(key(1), b"keep me" * 10)
    before = shm_digest(cache_name)
    with pytest.raises(SegmentMismatchError) as e:
        Store.open_or_create(cache_name, 8 * MiB, alignment=256)
    assert "capacity_bytes: segment has 4194304, this process asked for 8388608" in str(e.value)
    with pytest.raises(SegmentMismatchError, match="alignment"):
        Store.open_or_create(cache_name, 4 * MiB, alignment=4096)
    assert shm_digest(cache_name) == before
    assert a.get(key(1)) == b"keep me" * 10
    a.close()


def test_foreign_or_other_version_segment_is_refused_untouched(cache_name):
    path = f"/dev/shm/{cache_name}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.write(fd, os.urandom(1 << 16))
    os.close(fd)
    before = shm_digest(cache_name)
    with pytest.raises(SegmentMismatchError, match="magic"):
        Store.attach(cache_name)
    assert shm_digest(cache_name) == before
    os.unlink(path)

    s = Store.create(cache_name, 2 * MiB)
    s.close()
    del s
    with open(path, "r+b") as f:  # bump the format version field (offset 8)
        f.seek(8)
        f.write((99).to_bytes(4, "little"))
    before = shm_digest(cache_name)
    with pytest.raises(SegmentMismatchError, match="format version 99"):
        Store.attach(cache_name)
    assert shm_digest(cache_name) == before


def test_stale_segment_is_reinitialised_by_create(cache_name, child):
    c = child(f"""
        from shmkv import Store
        s = Store.create({cache_name!r}, 4 << 20)
        s.put(bytes(16), b"stale" * 100)
        print("done", flush=True)
    """)
    c.expect("done")
    c.finish()
    s = Store.create(cache_name, 4 * MiB)
    assert s.outcome is OpenOutcome.REINITIALISED_STALE
    assert s.get(bytes(16)) is None and s.stats()["entries"] == 0
    s.close()


def test_stale_segment_with_same_geometry_is_adopted_by_open_or_create(cache_name, child):
    c = child(f"""
        from shmkv import Store
        s = Store.create({cache_name!r}, 4 << 20)
        s.put(bytes(16), b"kept" * 100)
        lease = s.acquire(bytes(16))   # held when the process exits
        print("done", flush=True)
    """)
    c.expect("done")
    c.finish()
    s = Store.open_or_create(cache_name, 4 * MiB)
    assert s.outcome is OpenOutcome.ADOPTED_STALE
    assert s.get(bytes(16)) == b"kept" * 100
    assert s.stats()["leases_held"] == 0, "the dead process's lease was reclaimed"
    assert s.check_consistency() == []
    s.close()
    del s
    t = Store.open_or_create(cache_name, 8 * MiB)  # other geometry: re-initialised
    assert t.outcome is OpenOutcome.REINITIALISED_STALE
    assert t.get(bytes(16)) is None
    t.close()


def test_too_small_dev_shm_fails_at_creation_with_sizes(cache_name):
    huge = 1 << 50
    with pytest.raises(NoSpaceError) as e:
        Store.create(cache_name, huge)
    msg = str(e.value)
    assert str(huge) in msg and "/dev/shm has" in msg and "free" in msg
    assert not os.path.exists(f"/dev/shm/{cache_name}"), "no half-made segment is left"


def test_segment_of_another_owner_or_mode_is_refused(cache_name):
    s = Store.create(cache_name, 2 * MiB)
    os.chmod(f"/dev/shm/{cache_name}", 0o644)
    with pytest.raises(PermissionDeniedError, match="mode 0644"):
        Store.attach(cache_name)
    os.chmod(f"/dev/shm/{cache_name}", 0o600)
    s.close()


@pytest.mark.parametrize("name", ["", "a/b", ".hidden", "x" * 201, "spaces here"])
def test_invalid_names(name):
    with pytest.raises(InvalidArgumentError, match="invalid cache name"):
        Store.create(name, 2 * MiB)


def test_invalid_geometry_names_the_field(cache_name):
    with pytest.raises(InvalidArgumentError, match="alignment"):
        Store.create(cache_name, 2 * MiB, alignment=100)
    with pytest.raises(InvalidArgumentError, match="capacity_bytes"):
        Store.create(cache_name, 1000)
    with pytest.raises(InvalidArgumentError, match="max_payload_bytes"):
        Store.create(cache_name, 2 * MiB, max_payload_bytes=4 * MiB)
