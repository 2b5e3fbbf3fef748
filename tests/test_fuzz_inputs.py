"""Malformed input, fuzzed with hypothesis: chunk files and remote values
(the disk format parser), controller requests, and segment files of garbage
or damaged metadata. Each gives a clean error or a miss: never a crash, a
hang, an unexpected exception type, or bytes that are not the original."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
import xxhash
from helpers import REPO, key, payload_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmkv import Store
from shmkv.config import load_config
from shmkv.services.controller import Controller
from shmkv.tiers import TierChain
from shmkv.tiers import format as fmt
from shmkv.tiers.disk.tier import DiskTier

KEY, NS = key("fuzz"), b"F" * 16
RAW = payload_for(KEY, 3000)
GOOD = fmt.encode(KEY, NS, RAW)


# ------------------------------------------------------------ disk format --
def decode_or_damaged(data: bytes):
    """decode() may only return the original or raise DamagedChunk."""
    try:
        raw, ns = fmt.decode(data, KEY)
    except fmt.DamagedChunk:
        return None
    assert (raw, ns) == (RAW, NS), "a damaged chunk decoded to other bytes"
    return raw


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=2048))
def test_random_bytes_are_damaged(data):
    assert decode_or_damaged(data) is None or data == GOOD


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(GOOD) - 1), st.integers(0, 255)), min_size=1, max_size=8))
def test_mutated_chunks_never_decode_to_other_bytes(edits):
    data = bytearray(GOOD)
    for pos, val in edits:
        data[pos] = val
    decode_or_damaged(bytes(data))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, len(GOOD) + 100), st.binary(max_size=64))
def test_truncated_or_extended_chunks(cut, tail):
    decode_or_damaged(GOOD[:cut] + (tail if cut >= len(GOOD) else b""))


@settings(max_examples=100, deadline=None)
@given(st.integers(0, (1 << 64) - 1), st.integers(0, (1 << 64) - 1), st.sampled_from([1, 2, 3, 4, 8, 0, 255]))
def test_forged_header_with_a_valid_header_checksum(raw_len, comp_len, element_size):
    """An attacker can forge the header checksum (it is no MAC): lengths and
    element size that lie are still caught, without a huge allocation."""
    fields = list(fmt._HEADER.unpack_from(GOOD))
    fields[2], fields[7], fields[8] = element_size, raw_len, comp_len
    head = fmt._HEADER.pack(*fields)
    forged = head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + GOOD[fmt.HEADER_BYTES:]
    decode_or_damaged(forged)


def test_garbage_files_in_the_disk_tier_are_misses(tmp_path):
    counts: dict[str, int] = {}
    disk = DiskTier(str(tmp_path / "d"), capacity_bytes=1 << 30,
                    counter=lambda n, k: counts.__setitem__(n, counts.get(n, 0) + k))
    for i, junk in enumerate([b"", os.urandom(10), os.urandom(5000), GOOD[:-1], GOOD.replace(KEY, key(1))]):
        k = key(f"junk-{i}")
        with open(disk.path(k), "wb") as f:
            f.write(junk)
        assert disk.read(k) is None
        assert not os.path.exists(disk.path(k)), "a damaged file is removed"
    assert counts["disk_damaged"] == 5


# ------------------------------------------------------------- controller --
@pytest.fixture(scope="module")
def controller(tmp_path_factory):
    import uuid

    name = f"shmkv-test-{uuid.uuid4().hex[:12]}"
    cfg = load_config({"cache_name": name, "capacity": "8MiB", "chunk_size": 32, "populate": False,
                       "disk_dir": str(tmp_path_factory.mktemp("disk"))})
    store = Store.create(name, 8 << 20, populate=False)
    disk = DiskTier(os.path.join(cfg.disk_dir, name), capacity_bytes=1 << 30, counter=store.bump)
    for i in range(8):
        store.put(key(i), payload_for(key(i), 1000))
    yield Controller(cfg, store, TierChain(store, [disk]))
    store.close()
    Store.unlink(name)


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=12), children, max_size=6),
    max_leaves=30)
FIELDS = st.sampled_from(["tokens", "namespace", "to", "chunk_size", "block_size", "x"])
BODIES = st.one_of(
    st.binary(max_size=300),
    JSONISH.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(FIELDS, st.one_of(
        JSONISH, st.lists(st.integers(-5, (1 << 32) + 5), max_size=80),
        st.text(alphabet="0123456789abcdefxyz", min_size=30, max_size=34)), max_size=5).map(
        lambda d: json.dumps(d).encode()),
)
PATHS = st.sampled_from(["/health", "/stats", "/metrics", "/namespaces", "/lookup", "/clear", "/pin", "/unpin",
                         "/move", "/flush", "/", "/lookup/", "/lookup?x=1", "/../etc/passwd", "//clear"]) | st.text(
    max_size=30)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD"]), PATHS, BODIES)
def test_controller_requests_never_fail_inside(controller, method, path, body):
    before = controller.store.stats()["entries"]
    status, ctype, out = controller.handle(method, path, body)
    assert status == 200 or 400 <= status < 500, (status, out)
    if status >= 400:
        assert ctype == "application/json" and json.loads(out)["error"]
        assert controller.store.stats()["entries"] == before, "a refused request changed the cache"
    else:
        assert out


# ---------------------------------------------------------------- segment --
SEGMENT_FUZZ = r"""
import os, random, sys
from shmkv import Store, _C
from shmkv.errors import ShmkvError
name, seed, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
path = "/dev/shm/" + name
s = Store.create(name, 4 << 20, max_entries=1024, populate=False)
keys = [os.urandom(16) for _ in range(40)]
for i, k in enumerate(keys):
    s.put(k, bytes([i]) * (100 + 37 * i))
s.pin(keys[0])
lease = s.acquire(keys[1])
meta = s.stats()["capacity_bytes"] - s.arena_bytes
image = open(path, "rb").read()
lease.release()
s.close()
os.unlink(path)
rng = random.Random(seed)
outcomes = {}
for _ in range(n):
    kind = rng.choice(["garbage", "bytes", "range", "words", "truncate", "extend"])
    b = bytearray(image)
    if kind == "garbage":
        b = bytearray(os.urandom(rng.choice([0, 1, 63, 4096, 1 << 16, len(image)])))
    elif kind == "bytes":
        for _ in range(rng.randrange(1, 60)):
            b[rng.randrange(meta)] = rng.randrange(256)
    elif kind == "range":
        a = rng.randrange(meta)
        m = min(rng.randrange(1, 4096), meta - a)
        b[a:a + m] = os.urandom(m)
    elif kind == "words":
        for _ in range(rng.randrange(1, 30)):
            a = rng.randrange(0, meta - 8, 4)
            v = rng.choice([0, 1, 2, 3, 0xFFFFFFFF, 0x7FFFFFFF, rng.randrange(1 << 32)])
            b[a:a + 4] = v.to_bytes(4, "little")
    elif kind == "truncate":
        b = b[:rng.randrange(len(b))]
    else:
        b += os.urandom(rng.randrange(1, 1 << 16))
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    os.write(fd, bytes(b))
    os.close(fd)
    def exercise(st):
        for k in keys:
            st.get(k)
        st.put(os.urandom(16), b"x" * 5000)
        st.lookup_prefix(keys)
        problems = st.check_consistency()
        assert not problems, (kind, problems[:3])
        st.entries(), st.stats(), st.reclaim()
    try:  # attach: refused cleanly, or adopted after a rebuild
        st = Store.attach(name, populate=False)
        try:
            exercise(st)
            tag = "attach:adopted"
        finally:
            st.close()
    except ShmkvError as e:
        tag = "attach:" + type(e).__name__
    outcomes[tag] = outcomes.get(tag, 0) + 1
    # open_or_create always ends with a usable segment (adopted, or re-initialised)
    st = Store.open_or_create(name, 4 << 20, max_entries=1024, populate=False)
    try:
        exercise(st)
        tag = "open_or_create:" + st.outcome.name
    finally:
        st.close()
    outcomes[tag] = outcomes.get(tag, 0) + 1
    if os.path.exists(path):
        os.unlink(path)
print(outcomes)
"""


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_damaged_segment_files_give_clean_errors(cache_name, seed):
    """Run in a child process: a crash would show as its exit status."""
    r = subprocess.run([sys.executable, "-c", SEGMENT_FUZZ, cache_name, str(seed), "250"], capture_output=True,
                       text=True, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    outcomes = eval(r.stdout.strip().splitlines()[-1])  # noqa: S307 - our child's dict literal
    attach = {k: v for k, v in outcomes.items() if k.startswith("attach:")}
    reopen = {k: v for k, v in outcomes.items() if k.startswith("open_or_create:")}
    assert sum(attach.values()) == 250 and sum(reopen.values()) == 250, outcomes
    assert set(attach) <= {"attach:adopted", "attach:SegmentCorruptError", "attach:SegmentMismatchError"}, outcomes
    assert attach.get("attach:adopted") and len(attach) > 1, f"the fuzz should reach both outcomes: {outcomes}"
    assert set(reopen) <= {"open_or_create:ADOPTED_STALE", "open_or_create:REINITIALISED_STALE"}, outcomes
