"""The on-disk (and remote) chunk format: a checked header, then the payload,
either byte-plane shuffled and compressed with zstd, or as it is.

    offset size
    0      8    magic b"SHMKVCK1"
    8      2    format version (2; version 1, always zstd, is still read)
    10     1    element size used for the byte-plane shuffle (1 = none)
    11     1    codec: 0 = zstd of the shuffled payload, 1 = none (the raw payload)
    12     4    zstd level (0 with codec none)
    16     16   namespace digest (root key of the chunk's namespace)
    32     16   chunk key
    48     8    raw payload length
    56     8    compressed body length
    64     16   xxh3-128 of the raw payload
    80     8    xxh3-64 of bytes 0..80 (the header itself)
    88     ...  zstd frame of the shuffled payload, or the raw payload

Byte-plane shuffle: the payload viewed as [n, element_size] bytes is stored
transposed (all first bytes, then all second bytes...). For bf16 KV the
exponent bytes compress well once separated from the noisy mantissas. A tail
shorter than one element is kept as is.

decode() verifies everything it can before returning bytes: magic, version,
codec, header checksum, lengths against the file size, the key it was asked
for, and the payload checksum after decompression, for every codec. Anything
else raises DamagedChunk, which callers turn into a miss.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import xxhash
import zstandard

from shmkv import _C

MAGIC = b"SHMKVCK1"
VERSION = 2
READABLE_VERSIONS = (1, 2)
CODEC_ZSTD, CODEC_NONE = 0, 1
CODEC_IDS = {"zstd": CODEC_ZSTD, "none": CODEC_NONE}
_HEADER = struct.Struct("<8sHBBi16s16sQQ16s")  # 80 bytes
HEADER_BYTES = _HEADER.size + 8
assert _HEADER.size == 80


class DamagedChunk(Exception):
    """A stored chunk failed a check; `reason` says which."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def shuffle(raw: bytes | memoryview, element_size: int) -> bytes:
    """Elements -> byte planes (C++, without the GIL)."""
    return _C.byte_shuffle(raw, max(1, element_size))


def unshuffle(data: bytes, element_size: int) -> bytes:
    return _C.byte_unshuffle(data, max(1, element_size))


def encode(key: bytes, namespace: bytes, raw: bytes | memoryview, *, element_size: int = 2,
           level: int = 1, compressor: zstandard.ZstdCompressor | None = None, codec: str = "zstd") -> bytes:
    """The complete file contents for one chunk (`codec`: "zstd" or "none")."""
    return b"".join(encode_parts(key, namespace, raw, element_size=element_size, level=level,
                                 compressor=compressor, codec=codec))


def encode_parts(key: bytes, namespace: bytes, raw: bytes | memoryview, *, element_size: int = 2,
                 level: int = 1, compressor: zstandard.ZstdCompressor | None = None,
                 codec: str = "zstd") -> tuple[bytes, bytes | memoryview]:
    """(header, body) of one chunk: with codec "none" the body is `raw`
    itself, not a copy (a writer gives both to writev)."""
    if len(key) != 16 or len(namespace) != 16:
        raise ValueError("key and namespace digest must be 16 bytes")
    if codec == "none":
        body: bytes | memoryview = raw
        level = 0
    elif codec == "zstd":
        body = (compressor or zstandard.ZstdCompressor(level=level)).compress(shuffle(raw, element_size))
    else:
        raise ValueError(f"codec {codec!r}: expected one of {sorted(CODEC_IDS)}")
    head = _HEADER.pack(MAGIC, VERSION, element_size, CODEC_IDS[codec], level, namespace, key, len(raw), len(body),
                        xxhash.xxh3_128_digest(raw))
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)), body


def read_header(head: bytes) -> tuple[int, bytes, bytes, int, int, bytes]:
    """(element_size, namespace, key, raw_len, comp_len, checksum) of a header."""
    if len(head) < HEADER_BYTES:
        raise DamagedChunk("truncated header")
    fields = _HEADER.unpack_from(head)
    magic, version, es, codec, _level, ns, key, raw_len, comp_len, checksum = fields
    if magic != MAGIC:
        raise DamagedChunk("not a shmkv chunk (bad magic)")
    if version not in READABLE_VERSIONS:
        raise DamagedChunk(f"chunk format version {version}, expected one of {READABLE_VERSIONS}")
    (hsum,) = struct.unpack_from("<Q", head, _HEADER.size)
    if hsum != xxhash.xxh3_64_intdigest(head[:_HEADER.size]):
        raise DamagedChunk("header checksum mismatch")
    if codec not in (CODEC_ZSTD, CODEC_NONE) or (version == 1 and codec != CODEC_ZSTD):
        raise DamagedChunk(f"unknown codec {codec}")
    if codec == CODEC_NONE and comp_len != raw_len:
        raise DamagedChunk(f"raw body of {comp_len} bytes, header says {raw_len}")
    return es, ns, key, raw_len, comp_len, checksum


def codec_of(head: bytes) -> str:
    """The codec name of a (checked) header."""
    return "none" if head[11] == CODEC_NONE else "zstd"


def decode(data: bytes | memoryview, key: bytes | None = None, *, max_raw: int = 1 << 34,
           decompressor: zstandard.ZstdDecompressor | None = None) -> tuple[bytearray, bytes]:
    """(raw payload, namespace digest) of a chunk file, after every check."""
    got = decode_into(data, key, lambda n, _ns: bytearray(n), max_raw=max_raw, decompressor=decompressor)
    assert got is not None  # the allocator above always gives a buffer
    return got


def decode_into(data: bytes | memoryview, key: bytes | None, alloc: Callable[[int, bytes], Any], *,
                namespace: bytes | None = None, max_raw: int = 1 << 34,
                decompressor: zstandard.ZstdDecompressor | None = None) -> tuple[Any, bytes] | None:
    """Decode a chunk straight into the buffer alloc(raw_len, namespace)
    gives (a reservation of the shared tier: no copy in between), after the
    same checks as decode(); `key` and `namespace`, if given, must be the chunk's.
    Returns (that buffer, namespace), or None when alloc gave none. Raises
    DamagedChunk; the caller then discards what alloc gave."""
    es, ns, stored_key, raw_len, comp_len, checksum = read_header(data[:HEADER_BYTES])
    if key is not None and stored_key != key:
        raise DamagedChunk("file holds another key")
    if namespace is not None and ns != namespace:
        raise DamagedChunk("chunk names another namespace")
    if len(data) != HEADER_BYTES + comp_len:
        raise DamagedChunk(f"length {len(data)} != header + body {HEADER_BYTES + comp_len}")
    if raw_len > max_raw:
        raise DamagedChunk(f"raw length {raw_len} exceeds the limit {max_raw}")
    body = memoryview(data)[HEADER_BYTES:]
    shuffled = None
    if data[11] != CODEC_NONE:  # decompress before taking room: a bad frame costs no reservation
        shuffled = _decompress(body, raw_len, decompressor)
    buf = alloc(raw_len, ns)
    if buf is None:
        return None
    out = memoryview(buf).cast("B")
    if shuffled is None:
        out[:] = body
    else:
        _C.byte_unshuffle_into(shuffled, max(1, es), out)
    if xxhash.xxh3_128_digest(out) != checksum:
        raise DamagedChunk("payload checksum mismatch")
    return buf, ns


def _decompress(body: memoryview, raw_len: int, decompressor: zstandard.ZstdDecompressor | None) -> bytes:
    """The zstd frame of a body, exactly raw_len bytes, or DamagedChunk.
    Bounded: a frame declaring another size is refused before anything is
    allocated (one-shot decompress trusts a declared size), and one declaring
    none gets at most raw_len bytes. One-shot decompression runs without the
    GIL, so threads decode in parallel."""
    try:
        declared = zstandard.frame_content_size(body)
        if declared not in (-1, raw_len):
            raise DamagedChunk(f"zstd frame declares {declared} bytes, the header {raw_len}")
        shuffled = (decompressor or zstandard.ZstdDecompressor()).decompress(body, max_output_size=raw_len)
    except zstandard.ZstdError as e:
        raise DamagedChunk(f"zstd: {e}") from e
    if len(shuffled) != raw_len:
        raise DamagedChunk("decompressed length mismatch")
    return shuffled

