"""The on-disk (and remote) chunk format: a checked header, then the payload
byte-plane shuffled and compressed with zstd.

    offset size
    0      8    magic b"SHMKVCK1"
    8      2    format version (1)
    10     1    element size used for the byte-plane shuffle (1 = none)
    11     1    flags (reserved, 0)
    12     4    zstd level
    16     16   namespace digest (root key of the chunk's namespace)
    32     16   chunk key
    48     8    raw payload length
    56     8    compressed body length
    64     16   xxh3-128 of the raw payload
    80     8    xxh3-64 of bytes 0..80 (the header itself)
    88     ...  zstd frame of the shuffled payload

Byte-plane shuffle: the payload viewed as [n, element_size] bytes is stored
transposed (all first bytes, then all second bytes...). For bf16 KV the
exponent bytes compress well once separated from the noisy mantissas. A tail
shorter than one element is kept as is.

decode() verifies everything it can before returning bytes: magic, version,
header checksum, lengths against the file size, the key it was asked for,
and the payload checksum after decompression. Anything else raises
DamagedChunk, which callers turn into a miss.
"""

from __future__ import annotations

import struct

import xxhash
import zstandard

from shmkv import _C

MAGIC = b"SHMKVCK1"
VERSION = 1
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
           level: int = 1, compressor: zstandard.ZstdCompressor | None = None) -> bytes:
    """The complete file contents for one chunk."""
    if len(key) != 16 or len(namespace) != 16:
        raise ValueError("key and namespace digest must be 16 bytes")
    body = (compressor or zstandard.ZstdCompressor(level=level)).compress(shuffle(raw, element_size))
    head = _HEADER.pack(MAGIC, VERSION, element_size, 0, level, namespace, key, len(raw), len(body),
                        xxhash.xxh3_128_digest(raw))
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + body


def read_header(head: bytes) -> tuple[int, bytes, bytes, int, int, bytes]:
    """(element_size, namespace, key, raw_len, comp_len, checksum) of a header."""
    if len(head) < HEADER_BYTES:
        raise DamagedChunk("truncated header")
    fields = _HEADER.unpack_from(head)
    magic, version, es, _flags, _level, ns, key, raw_len, comp_len, checksum = fields
    if magic != MAGIC:
        raise DamagedChunk("not a shmkv chunk (bad magic)")
    if version != VERSION:
        raise DamagedChunk(f"chunk format version {version}, expected {VERSION}")
    (hsum,) = struct.unpack_from("<Q", head, _HEADER.size)
    if hsum != xxhash.xxh3_64_intdigest(head[:_HEADER.size]):
        raise DamagedChunk("header checksum mismatch")
    return es, ns, key, raw_len, comp_len, checksum


def decode(data: bytes, key: bytes | None = None, *, max_raw: int = 1 << 34,
           decompressor: zstandard.ZstdDecompressor | None = None) -> tuple[bytes, bytes]:
    """(raw payload, namespace digest) of a chunk file, after every check."""
    es, ns, stored_key, raw_len, comp_len, checksum = read_header(data[:HEADER_BYTES])
    if key is not None and stored_key != key:
        raise DamagedChunk("file holds another key")
    if len(data) != HEADER_BYTES + comp_len:
        raise DamagedChunk(f"length {len(data)} != header + body {HEADER_BYTES + comp_len}")
    if raw_len > max_raw:
        raise DamagedChunk(f"raw length {raw_len} exceeds the limit {max_raw}")
    try:
        # bounded read: a forged frame cannot make us allocate more than raw_len + 1
        reader = (decompressor or zstandard.ZstdDecompressor()).stream_reader(
            memoryview(data)[HEADER_BYTES:], read_across_frames=False)
        shuffled = reader.read(raw_len + 1)
    except zstandard.ZstdError as e:
        raise DamagedChunk(f"zstd: {e}") from e
    if len(shuffled) != raw_len:
        raise DamagedChunk("decompressed length mismatch")
    raw = unshuffle(shuffled, es)
    if xxhash.xxh3_128_digest(raw) != checksum:
        raise DamagedChunk("payload checksum mismatch")
    return raw, ns
