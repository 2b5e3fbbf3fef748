"""Size before work: a stored chunk whose header declares more bytes than the
reader can hold (a zstd bomb: 32 KB that inflate to 1 GiB) is a miss, counted
and removed where it came from (a disk file, a Redis value), before anything is
decompressed or allocated; nothing escapes the tier chain and the reader's
memory stays flat. The promotions run in a child process so that its peak RSS
measures them alone."""

from __future__ import annotations

import functools
import json
import struct
import subprocess
import sys

import xxhash
import zstandard
from helpers import key

from shmkv import Store
from shmkv.tiers import format as fmt
from shmkv.tiers.disk.tier import DiskTier
from shmkv.tiers.remote.signing import chunk_key

NS = b"N" * 16
BOMB_RAW = 1 << 30
ATTEMPTS = 5
PEAK_LIMIT = 256 << 20

CHILD = r"""
import json, resource, sys
from shmkv import Store
from shmkv.config import load_config
from shmkv.tiers import open_tiers
cfg, keys, ns = json.loads(sys.argv[1]), [bytes.fromhex(k) for k in json.loads(sys.argv[2])], bytes.fromhex(sys.argv[3])
store = Store.attach(cfg["cache_name"], populate=False, background_reserve=False)
chain = open_tiers(load_config(cfg, env={}), store)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
promoted = [chain.promote([k], [ns]) for k in keys]
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
chain.close()
print(json.dumps({"promoted": promoted, "peak_growth": peak - before, "stats": store.stats()}))
"""


@functools.cache
def _zeros_frame(raw_len: int) -> tuple[bytes, bytes]:
    """A zstd frame of raw_len zero bytes and their xxh3-128, built 1 MiB at a
    time (never holding them). Level 1: zeros shrink as far as at level 19
    (about 32 KB per GiB, RLE blocks) in a twentieth of the time."""
    co = zstandard.ZstdCompressor(level=1).compressobj(size=raw_len)
    zero = bytes(1 << 20)
    digest = xxhash.xxh3_128()
    body = []
    for _ in range(raw_len // len(zero)):
        body.append(co.compress(zero))
        digest.update(zero)
    body.append(co.flush())
    return b"".join(body), digest.digest()


def zstd_bomb(k: bytes, ns: bytes, raw_len: int = BOMB_RAW) -> bytes:
    """A well-formed chunk (sound header and frame) of raw_len zero bytes,
    built without ever holding them: about 32 KB."""
    frame, digest = _zeros_frame(raw_len)
    head = struct.pack("<8sHBBi16s16sQQ16s", fmt.MAGIC, fmt.VERSION, 2, fmt.CODEC_ZSTD, 1, ns, k, raw_len,
                       len(frame), digest)
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + frame


def promote_in_child(cfg: dict, keys: list[bytes]) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg), json.dumps([k.hex() for k in keys]),
                          NS.hex()], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_disk_bomb_is_a_miss_and_is_removed(cache_name, tmp_path):
    Store.create(cache_name, 64 << 20, populate=False).close()  # its largest payload: 16 MiB
    disk = DiskTier(str(tmp_path / cache_name), capacity_bytes=1 << 30)
    keys = [key(("bomb", i)) for i in range(ATTEMPTS)]
    for k in keys:
        assert disk.write_encoded(k, zstd_bomb(k, NS))
    assert all(disk.contains(keys))
    got = promote_in_child({"cache_name": cache_name, "disk_dir": str(tmp_path)}, keys)
    assert got["promoted"] == [0] * ATTEMPTS
    assert got["stats"]["disk_damaged"] == ATTEMPTS and got["stats"]["promote_errors"] == 0
    assert got["peak_growth"] < PEAK_LIMIT, f"peak RSS grew by {got['peak_growth'] >> 20} MiB"
    assert not any(disk.contains(keys)), "every bomb file is removed"


def test_a_remote_bomb_is_a_miss_and_is_unlinked(cache_name, redis_server):
    Store.create(cache_name, 64 << 20, populate=False).close()
    client = redis_server.client()
    keys = [key(("bomb", i)) for i in range(ATTEMPTS)]
    bomb = zstd_bomb(keys[0], NS)
    assert len(bomb) < 64 << 10, "the bomb is small"
    for k in keys:
        client.set(chunk_key(k, NS), zstd_bomb(k, NS))
    got = promote_in_child({"cache_name": cache_name, "remote_url": redis_server.url}, keys)
    assert got["promoted"] == [0] * ATTEMPTS
    assert got["stats"]["remote_damaged"] == ATTEMPTS and got["stats"]["promote_errors"] == 0
    assert got["peak_growth"] < PEAK_LIMIT, f"peak RSS grew by {got['peak_growth'] >> 20} MiB"
    assert not any(client.exists(chunk_key(k, NS)) for k in keys), "every bomb value is unlinked"


def test_an_engine_refuses_chunks_larger_than_its_layout(cache_name, tmp_path):
    """Within the segment's bound but above the engine's chunk: refused too."""
    from shmkv.config import load_config
    from shmkv.tiers import open_tiers

    store = Store.create(cache_name, 64 << 20, populate=False)
    disk_dir = tmp_path / "d"
    disk = DiskTier(str(disk_dir / cache_name), capacity_bytes=1 << 30)
    k = key("big")
    assert disk.write_encoded(k, zstd_bomb(k, NS, 8 << 20))  # 8 MiB < the 16 MiB largest payload
    chain = open_tiers(load_config({"cache_name": cache_name, "disk_dir": str(disk_dir)}, env={}), store,
                       max_chunk_bytes=1 << 20)
    assert chain.promote([k], [NS]) == 0
    assert store.stats()["disk_damaged"] == 1 and not disk.contains([k])[0]
    chain.close()
    store.close()


def test_a_failing_tier_is_a_miss_not_an_error(cache_name):
    """Whatever a tier raises stays in the chain: a counted miss."""
    from shmkv.tiers import TierChain

    class Broken:
        name = "disk"

        def contains(self, keys, namespaces):
            return [True] * len(keys)

        def fetch_into(self, k, ns, alloc, *, max_raw=None):
            alloc(1024, ns)  # takes room first, then fails
            raise MemoryError("a tier that fails its own way")

    store = Store.create(cache_name, 16 << 20, populate=False)
    chain = TierChain(store, [Broken()])
    assert chain.promote([key(1)], [NS]) == 0
    st = store.stats()
    assert st["promote_errors"] == 1 and st["ready_entries"] == 0 and st["bytes_used"] == 0
    assert store.check_consistency() == []
    store.close()


def test_a_direct_read_of_a_chain_tier_is_bounded_by_the_segment(cache_name, tmp_path):
    """DiskTier.read called directly (an operator's tool, a test) on a tier the
    chain built holds the chain's bound, not the format's 16 GiB: a chunk
    declaring more than the segment's largest payload is refused unread."""
    from shmkv.config import load_config
    from shmkv.tiers import open_tiers

    with Store.create(cache_name, 64 << 20, populate=False) as store:  # its largest payload: 16 MiB
        chain = open_tiers(load_config({"cache_name": cache_name, "disk_dir": str(tmp_path)}, env={}), store)
        try:
            k = key(("direct", 1))
            assert chain.disk.write_encoded(k, zstd_bomb(k, NS, raw_len=32 << 20))
            assert chain.disk.read(k) is None
            assert store.stats()["disk_damaged"] == 1 and not chain.disk.contains([k])[0]
        finally:
            chain.close()


def test_a_disk_tier_built_alone_is_bounded_too(tmp_path):
    """A DiskTier outside any chain (an operator's tool, a benchmark) holds
    the format's own bound (512 MiB): the 1 GiB bomb is refused unread and
    removed, and nothing is allocated for it."""
    disk = DiskTier(str(tmp_path / "alone"), capacity_bytes=1 << 30)
    assert disk.max_raw == fmt.MAX_RAW < BOMB_RAW
    k = key(("alone", 1))
    assert disk.write_encoded(k, zstd_bomb(k, NS))
    asked = []
    assert disk.fetch_into(k, NS, lambda n, _ns: asked.append(n) or bytearray(n)) is None
    assert asked == [] and not disk.contains([k])[0]
