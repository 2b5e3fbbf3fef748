"""The on-disk (and remote) chunk format: a checked header, then the payload,
either byte-plane shuffled and compressed with zstd, or as it is, or (only
for a lossy namespace, shmkv.keys.lossy_key) quantized to float8.

    offset size
    0      8    magic b"SHMKVCK1"
    8      2    format version (2; version 1, always zstd, is still read)
    10     1    element size used for the byte-plane shuffle (1 = none); with
                fp8, of the source dtype
    11     1    codec: 0 = zstd of the shuffled payload, 1 = none (the raw
                payload), 2 = fp8 (lossy)
    12     4    zstd level (0 with codec none); with fp8, the source dtype
                (1 bfloat16, 2 float16, 3 float32)
    16     16   namespace digest (root key of the chunk's namespace)
    32     16   chunk key
    48     8    raw payload length
    56     8    compressed body length
    64     16   xxh3-128 of the raw payload (with fp8: of what decoding gives)
    80     8    xxh3-64 of bytes 0..80 (the header itself)
    88     ...  zstd frame of the shuffled payload, or the raw payload

Byte-plane shuffle: the payload viewed as [n, element_size] bytes is stored
transposed (all first bytes, then all second bytes...). For bf16 KV the
exponent bytes compress well once separated from the noisy mantissas. A tail
shorter than one element is kept as is.

fp8 body: one float32 scale per FP8_GROUP values (absmax / 448), then every
value as float8 e4m3 (round to nearest). Decoding multiplies back, in the
source dtype; it is deterministic, so the checksum holds. decode() gives fp8
chunks only to a caller that asks for lossy data (lossy_ok).

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
from shmkv.names import FP8, RAW, ZSTD

MAGIC = b"SHMKVCK1"
VERSION = 2
READABLE_VERSIONS = (1, 2)
CODEC_ZSTD, CODEC_NONE, CODEC_FP8 = 0, 1, 2
CODEC_IDS = {ZSTD: CODEC_ZSTD, RAW: CODEC_NONE, FP8: CODEC_FP8}
CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}
FP8_GROUP = 1024  # values per scale
FP8_MAX = 448.0  # the largest finite float8 e4m3fn
FP8_SOURCES = {"bfloat16": 1, "float16": 2, "float32": 3}  # dtype -> header code
FP8_DTYPES = {v: k for k, v in FP8_SOURCES.items()}
_HEADER = struct.Struct("<8sHBBi16s16sQQ16s")  # 80 bytes
HEADER_BYTES = _HEADER.size + 8
# The bound of a reader that names none (a tier built alone: an operator's tool, a benchmark): 512 MiB, above a
# 256-token chunk of any model served today (a 405B model's is 126 MiB); a tier chain passes its segment's
# largest payload instead, and DiskTier / RemoteTier take `max_raw` for chunks beyond it.
MAX_RAW = 1 << 29
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
    if codec == RAW:
        body: bytes | memoryview = raw
        level = 0
    elif codec == FP8:
        raise ValueError("the fp8 form is made by encode_fp8(), which needs the payload's dtype")
    elif codec == ZSTD:
        body = (compressor or zstandard.ZstdCompressor(level=level)).compress(shuffle(raw, element_size))
    else:
        raise ValueError(f"codec {codec!r}: expected one of {sorted(CODEC_IDS)}")
    return _header(key, namespace, element_size, CODEC_IDS[codec], level, raw, len(body)), body


def _header(key: bytes, namespace: bytes, element_size: int, codec: int, level: int, raw: Any, body_len: int
            ) -> bytes:
    """The checked header of a chunk whose (decoded) payload is `raw`."""
    if len(key) != 16 or len(namespace) != 16:
        raise ValueError("key and namespace digest must be 16 bytes")
    head = _HEADER.pack(MAGIC, VERSION, element_size, codec, level, namespace, key, memoryview(raw).nbytes,
                        body_len, xxhash.xxh3_128_digest(raw))
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


def encode_fp8(key: bytes, namespace: bytes, raw: bytes | memoryview, dtype: str) -> tuple[bytes, float]:
    """(the chunk file of the fp8 form of `raw`, a payload of `dtype` values;
    the relative RMS error of that form). Raises ValueError when the payload
    is not whole values of that dtype or holds a non-finite value."""
    import torch

    if dtype not in FP8_SOURCES:
        raise ValueError(f"fp8 form of {dtype!r} KV: expected one of {sorted(FP8_SOURCES)}")
    src = torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype))  # NOTE: a copy; raw may be read-only
    x = src.float()
    if not bool(torch.isfinite(x).all()):
        raise ValueError("the payload holds a value that is not finite")
    n = x.numel()
    pad = -n % FP8_GROUP
    groups = torch.nn.functional.pad(x, (0, pad)).view(-1, FP8_GROUP)
    scales = groups.abs().amax(dim=1) / FP8_MAX
    scales[scales == 0] = 1.0
    q = (groups / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(-1)[:n]
    body = scales.numpy().tobytes() + q.view(torch.uint8).numpy().tobytes()
    out = _dequantize(q, scales, src.dtype)
    err = float(torch.linalg.vector_norm(out.float() - x) / max(float(torch.linalg.vector_norm(x)), 1e-30))
    head = _header(key, namespace, src.element_size(), CODEC_FP8, FP8_SOURCES[dtype], out.view(torch.uint8).numpy(),
                   len(body))
    return head + body, err


def _dequantize(q: Any, scales: Any, dtype: Any) -> Any:
    import torch

    n = q.numel()
    pad = -n % FP8_GROUP
    v = torch.nn.functional.pad(q.float(), (0, pad)).view(-1, FP8_GROUP) * scales[:, None]
    return v.view(-1)[:n].to(dtype)


def _decode_fp8(body: memoryview, es: int, source: int, raw_len: int, out: memoryview) -> None:
    """The fp8 body into `out` (raw_len bytes of the source dtype)."""
    import torch

    dtype = FP8_DTYPES.get(source)
    if dtype is None or getattr(torch, dtype).itemsize != es or raw_len % es:
        raise DamagedChunk(f"fp8 chunk of source dtype code {source} and element size {es}")
    n = raw_len // es
    groups = -(-n // FP8_GROUP)
    if len(body) != 4 * groups + n:
        raise DamagedChunk(f"fp8 body of {len(body)} bytes, {4 * groups + n} expected for {n} values")
    own = bytearray(body)  # NOTE: torch views only writable buffers; the body may be a lease's
    scales = torch.frombuffer(own, dtype=torch.float32, count=groups) if groups else torch.empty(0)
    q = torch.frombuffer(own, dtype=torch.float8_e4m3fn, offset=4 * groups, count=n) if n else torch.empty(
        0, dtype=torch.float8_e4m3fn)
    v = _dequantize(q, scales, getattr(torch, dtype))
    out[:] = v.view(torch.uint8).numpy().data


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
    if codec not in CODEC_NAMES or (version == 1 and codec != CODEC_ZSTD):
        raise DamagedChunk(f"unknown codec {codec}")
    if codec == CODEC_NONE and comp_len != raw_len:
        raise DamagedChunk(f"raw body of {comp_len} bytes, header says {raw_len}")
    return es, ns, key, raw_len, comp_len, checksum


def codec_of(head: bytes) -> str:
    """The codec name of a (checked) header."""
    return CODEC_NAMES.get(head[11], ZSTD)


def decode(data: bytes | memoryview, key: bytes | None = None, *, max_raw: int = MAX_RAW,
           decompressor: zstandard.ZstdDecompressor | None = None, lossy_ok: bool = False
           ) -> tuple[bytearray, bytes]:
    """(raw payload, namespace digest) of a chunk file, after every check."""
    got = decode_into(data, key, lambda n, _ns: bytearray(n), max_raw=max_raw, decompressor=decompressor,
                      lossy_ok=lossy_ok)
    assert got is not None  # the allocator above always gives a buffer
    return got


def decode_into(data: bytes | memoryview, key: bytes | None, alloc: Callable[[int, bytes], Any], *,
                namespace: bytes | None = None, max_raw: int = MAX_RAW,
                decompressor: zstandard.ZstdDecompressor | None = None, lossy_ok: bool = False
                ) -> tuple[Any, bytes] | None:
    """Decode a chunk straight into the buffer alloc(raw_len, namespace)
    gives (a reservation of the shared tier: no copy in between), after the
    same checks as decode(); `key` and `namespace`, if given, must be the chunk's;
    a lossy (fp8) chunk only with `lossy_ok`.
    Returns (that buffer, namespace), or None when alloc gave none. Raises
    DamagedChunk; the caller then discards what alloc gave."""
    es, ns, stored_key, raw_len, comp_len, checksum = read_header(data[:HEADER_BYTES])
    codec = data[11]
    if codec == CODEC_FP8 and not lossy_ok:
        raise DamagedChunk("a lossy (fp8) chunk where exact KV is asked for")
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
    if codec == CODEC_ZSTD:  # decompress before taking room: a bad frame costs no reservation
        shuffled = _decompress(body, raw_len, decompressor)
    buf = alloc(raw_len, ns)
    if buf is None:
        return None
    out = memoryview(buf).cast("B")
    if codec == CODEC_FP8:
        _decode_fp8(body, es, struct.unpack_from("<i", data, 12)[0], raw_len, out)
    elif shuffled is None:
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



def decode_or_none(data: bytes | memoryview, key: bytes, *, lossy_ok: bool = False) -> bytes | None:
    """The raw payload of an encoded chunk (every check above), or None if it
    is damaged (or lossy, unless `lossy_ok`)."""
    try:
        return decode(data, key, lossy_ok=lossy_ok)[0]
    except DamagedChunk:
        return None
