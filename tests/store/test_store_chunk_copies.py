"""Whole-chunk copies between the segment and a process's buffer
(Store.write_chunks / read_chunks: one call for many chunks, each reserved,
copied without the GIL and committed, or acquired, copied and released) and
the tri-state presence of a key (READY / WRITING / ABSENT)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import key, payload_for

from shmkv import PutResult, Store
from shmkv.errors import InvalidArgumentError, PayloadTooLargeError
from shmkv.store import Presence, ReadResult


@pytest.fixture
def store(cache_name):
    s = Store.create(cache_name, 8 << 20, alignment=64, max_entries=256, max_payload_bytes=1 << 20)
    yield s
    s.close()


def buffer_of(keys: list[bytes], size: int, offsets: list[int], total: int) -> np.ndarray:
    buf = np.zeros(total, np.uint8)
    for k, o in zip(keys, offsets):
        buf[o:o + size] = np.frombuffer(payload_for(k, size), np.uint8)
    return buf


# 3000 bytes: below the streaming threshold; 256 KiB + 7 at odd offsets:
# the streamed path with an unaligned head and a tail shorter than 64 bytes.
@pytest.mark.parametrize("size,offsets", [(3000, [0, 3000, 9001]), ((256 << 10) + 7, [5, (256 << 10) + 100])],
                         ids=["small", "streamed-unaligned"])
def test_chunks_written_and_read_back_are_byte_equal(store, size, offsets):
    keys = [key(f"c{size}-{i}") for i in range(len(offsets))]
    total = offsets[-1] + size + 64
    src = buffer_of(keys, size, offsets, total)
    assert store.write_chunks(keys, src, offsets, size, namespace=key("ns"), tokens=256) == [PutResult.OK] * len(keys)
    assert store.stats()["put_tokens"] == 256 * len(keys)
    for k in keys:
        assert store.get(k) == payload_for(k, size)
    out = np.full(total, 0xAB, np.uint8)
    back = list(reversed(offsets))  # other places than they came from
    assert store.read_chunks(keys, out, back, size) == [ReadResult.OK] * len(keys)
    for k, o in zip(keys, back):
        assert out[o:o + size].tobytes() == payload_for(k, size)
    untouched = np.ones(total, bool)
    for o in back:
        untouched[o:o + size] = False
    assert (out[untouched] == 0xAB).all(), "nothing written outside the chunks"
    assert store.stats()["leases_held"] == 0


def test_each_chunk_gets_its_own_outcome(store):
    size = 4096
    held, other_size, compressed = key("held"), key("other-size"), key("compressed")
    store.put(held, payload_for(held, size))
    store.put(other_size, payload_for(other_size, size // 2))
    store.put(compressed, payload_for(compressed, size), compressed=True)
    keys = [held, key("new"), other_size, compressed, key("absent")]
    src = np.zeros(size * len(keys), np.uint8)
    offsets = [i * size for i in range(len(keys))]
    assert store.write_chunks(keys[:2], src, offsets[:2], size) == [PutResult.EXISTS, PutResult.OK]
    out = np.zeros_like(src)
    assert store.read_chunks(keys, out, offsets, size) == [
        ReadResult.OK, ReadResult.OK, ReadResult.MISMATCH, ReadResult.MISMATCH, ReadResult.MISS]
    assert out[:size].tobytes() == payload_for(held, size)
    assert not out[2 * size:].any(), "nothing copied for a mismatch or a miss"
    assert store.stats()["leases_held"] == 0


def test_a_chunk_another_writer_holds_is_busy_and_writing(store):
    k = key("writing")
    r = store.reserve(k, 64)
    assert store.presence([k, key("nobody")]) == [Presence.WRITING, Presence.ABSENT]
    assert store.contains([k]) == [False], "an uncommitted chunk is not cached"
    assert store.write_chunks([k], np.zeros(64, np.uint8), [0], 64) == [PutResult.BUSY]
    assert store.read_chunks([k], np.zeros(64, np.uint8), [0], 64) == [ReadResult.MISS]
    r.view()[:] = b"w" * 64
    assert r.commit() is PutResult.OK
    assert store.presence([k]) == [Presence.READY]
    assert store.contains([k]) == [True]


def test_bad_arguments_name_themselves(store):
    keys = [key(1), key(2)]
    buf = np.zeros(1000, np.uint8)
    with pytest.raises(ValueError, match=r"chunk 1 at offset 600 \(\+500 bytes\) lies outside the 1000-byte buffer"):
        store.read_chunks(keys, buf, [0, 600], 500)
    with pytest.raises(ValueError, match="2 uint64 values, one per key"):
        store.write_chunks(keys, buf, [0], 500)
    with pytest.raises(ValueError, match="C-contiguous"):
        store.read_chunks(keys, np.zeros((100, 20), np.uint8)[:, :10], [0, 500], 500)
    with pytest.raises(PayloadTooLargeError, match="max_payload_bytes"):
        store.write_chunks(keys, np.zeros(4 << 20, np.uint8), [0, 2 << 20], 2 << 20)
    with pytest.raises(InvalidArgumentError, match="size must be > 0"):
        store.write_chunks(keys, buf, [0, 0], 0)
    with pytest.raises(BufferError, match="not writable"):
        store.read_chunks(keys, bytes(1000), [0, 500], 500)
    assert store.stats()["entries"] == 0
