"""The chunk file format: exact round trips with either codec (zstd, none),
the byte-plane shuffle, and every kind of damage detected whatever the codec;
files of format version 1 are still read."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from shmkv.tiers import format as fmt

KEY, NS = b"k" * 16, b"n" * 16


@pytest.mark.parametrize("codec", ["zstd", "none"])
@pytest.mark.parametrize("n", [0, 1, 3, 4096, 100_001])
@pytest.mark.parametrize("es", [1, 2, 4])
def test_round_trip_exact(n, es, codec):
    raw = os.urandom(n)
    data = fmt.encode(KEY, NS, raw, element_size=es, codec=codec)
    assert fmt.codec_of(data) == codec
    assert fmt.decode(data, KEY) == (raw, NS)
    assert fmt.unshuffle(fmt.shuffle(raw, es), es) == raw


def test_shuffle_groups_bytes_by_plane():
    raw = bytes([1, 2, 1, 2, 1, 2, 9])
    assert fmt.shuffle(raw, 2) == bytes([1, 1, 1, 2, 2, 2, 9])


def test_shuffle_helps_on_bf16():
    x = torch.randn(1 << 20).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    plain = len(fmt.encode(KEY, NS, x, element_size=1))
    shuffled = len(fmt.encode(KEY, NS, x, element_size=2))
    assert shuffled < plain


def damaged_variants(data: bytes) -> dict[str, bytes]:
    flip = bytearray(data)
    flip[len(data) // 2] ^= 0x40
    head_flip = bytearray(data)
    head_flip[50] ^= 1
    return {
        "truncated": data[: len(data) - 7],
        "bit flip in body": bytes(flip),
        "bit flip in header": bytes(head_flip),
        "zero length": b"",
        "foreign": b"PK\x03\x04" + os.urandom(200),
        "header only": data[: fmt.HEADER_BYTES],
        "trailing garbage": data + b"x",
    }


DECODERS = {"decode": lambda data: fmt.decode(data, KEY),
            "decode_into": lambda data: fmt.decode_into(data, KEY, lambda n, ns: bytearray(n))}


@pytest.mark.parametrize("decoder", list(DECODERS))
@pytest.mark.parametrize("codec", ["zstd", "none"])
@pytest.mark.parametrize("kind", list(damaged_variants(b"x" * 200)))
def test_damage_is_detected(kind, codec, decoder):
    raw = np.random.default_rng(0).standard_normal(5000).astype(np.float32).tobytes()
    bad = damaged_variants(fmt.encode(KEY, NS, raw, element_size=4, codec=codec))[kind]
    with pytest.raises(fmt.DamagedChunk):
        DECODERS[decoder](bad)


def _reheader(data: bytes, **fields) -> bytes:
    """`data` with header fields replaced and the header checksum made valid again."""
    import struct

    import xxhash

    head = bytearray(data[:80])
    for offset, value in fields.values():
        head[offset] = value
    return bytes(head) + struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(head))) + data[fmt.HEADER_BYTES:]


def test_an_unknown_codec_or_a_raw_body_of_the_wrong_length_is_damage():
    raw = os.urandom(1000)
    with pytest.raises(fmt.DamagedChunk, match="unknown codec"):
        fmt.decode(_reheader(fmt.encode(KEY, NS, raw), codec=(11, 7)), KEY)
    zstd_as_raw = _reheader(fmt.encode(KEY, NS, raw), codec=(11, fmt.CODEC_NONE))
    with pytest.raises(fmt.DamagedChunk):
        fmt.decode(zstd_as_raw, KEY)


def test_version_1_files_are_read():
    raw = os.urandom(5000)
    v1 = _reheader(fmt.encode(KEY, NS, raw), version=(8, 1))
    assert fmt.decode(v1, KEY) == (raw, NS)
    with pytest.raises(fmt.DamagedChunk, match="unknown codec"):  # version 1 knew only zstd
        fmt.decode(_reheader(fmt.encode(KEY, NS, raw, codec="none"), version=(8, 1)), KEY)


def test_wrong_key_is_rejected():
    data = fmt.encode(KEY, NS, b"payload")
    with pytest.raises(fmt.DamagedChunk, match="another key"):
        fmt.decode(data, b"z" * 16)


@pytest.mark.parametrize("codec", ["zstd", "none"])
@pytest.mark.parametrize("es", [1, 2])
def test_decode_into_a_given_buffer(codec, es):
    raw = torch.randn(40_000).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    data = fmt.encode(KEY, NS, raw, element_size=es, codec=codec)
    asked = []

    def alloc(n, ns):
        asked.append((n, ns))
        return bytearray(n)

    buf, ns = fmt.decode_into(data, KEY, alloc, namespace=NS)
    assert bytes(buf) == raw and ns == NS and asked == [(len(raw), NS)]
    assert fmt.decode_into(data, KEY, lambda n, ns: None) is None, "no room: nothing decoded"
    with pytest.raises(fmt.DamagedChunk, match="another namespace"):
        fmt.decode_into(data, KEY, alloc, namespace=b"x" * 16)


def test_unshuffle_into_needs_the_same_size():
    from shmkv import _C

    with pytest.raises(ValueError, match="destination of 3"):
        _C.byte_unshuffle_into(b"abcd", 2, bytearray(3))
    out = bytearray(7)
    _C.byte_unshuffle_into(fmt.shuffle(b"abcdefg", 2), 2, out)
    assert bytes(out) == b"abcdefg"
