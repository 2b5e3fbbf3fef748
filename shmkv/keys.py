"""Chunk keys: prefix-chained 128-bit XXH3 hashes of token ids.

    k_0 = xxh3_128(namespace)                      the root key
    k_i = xxh3_128(p_i || token ids of chunk i)
    p_i = k_{i-1}                                  a chunk of token ids alone
    p_i = xxh3_128(k_{i-1} || TAG || extras_i)     a chunk with other inputs

so a chunk's key names its whole token prefix and everything that makes its
bytes (in)compatible. Token ids are hashed as little-endian uint32; the
namespace is canonical JSON (sorted keys), so no two different namespaces
encode to the same bytes and no token sequence can produce a namespace.

What changes KV besides the token ids, and where it goes (the same inputs
vLLM's own block hash uses, vllm/v1/core/kv_cache_utils.py):
  * for the whole request (the namespace): the model and its geometry, dtype,
    TP size and rank, layout, chunk size, format, the cache salt, and the
    LoRA adapter (its name and a digest of its files: an adapter replaced
    under the same name is another namespace);
  * per chunk (`ExtraInputs.for_range`): the multimodal items overlapping the
    chunk (their identifier, which vLLM derives from the item's content, and
    their offset relative to the chunk's start) and a digest of the chunk's
    prompt-embedding rows. A chunk with such inputs chains from p_i, a
    16-byte mix of the previous key and the canonical JSON of its extras, so
    every hash input keeps the fixed shape of 16 key bytes then the tokens:
    no choice of token ids can stand in for an extra input, and a difference
    in any chunk changes the keys of that chunk and of every one after it.
A *lossy* form of a chunk (POST /compress with "lossy": "fp8") is never
stored under the chunk's key: it lives under lossy_key(k, form), a hash of
a tag, the form and k, in the namespace lossy_key(root, form). Only an engine
whose shmkv config sets `lossy_form` looks those keys up (and stores what it
computes from them there too); an exact engine never computes them, so no
request that did not opt in can load lossy KV.
An engine with an EAGLE or MTP drafter keys each chunk with lookahead_key(k,
next tokens): its drafter's KV of a chunk's last position was made from the
token after the chunk (its namespace also names the drafter).

Why not vLLM's own block hashes: they are per block (16 or 128 tokens, not
our chunks), their algorithm and seed are engine settings (Python's hash()
with a random PYTHONHASHSEED differs between processes), and they do not name
the model.

A prompt's tail that does not fill a whole chunk can still be cached as a
*piece*: a block-aligned prefix of the next chunk, keyed the same way over its
shorter token list (`piece_key`). Its hash input is shorter than any full
chunk's, so a piece never collides with a chunk, and nothing chains after it.

What the hash does and does not protect against: XXH3-128 is fast and
well-distributed but not cryptographic. Tenants are separated by the cache
salt inside the namespace; a tenant cannot reach another's keys by choosing
token ids without a 128-bit collision, which is beyond accidental reach but
not proven against a determined attacker. Never use Python's hash().
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import xxhash

from shmkv import _C
from shmkv.errors import ConfigError
from shmkv.names import LOSSY_FORMS

# tokens per chunk: the core's bounds (cpp/value_limits.h), the one rule every caller checks with check_chunk_size
CHUNK_SIZE_MIN, CHUNK_SIZE_MAX = _C.LIMITS["chunk_size"]


def check_chunk_size(value: object, what: str = "chunk_size") -> int:
    """`value` as tokens per chunk, or ConfigError naming `what` and the bounds."""
    if isinstance(value, bool) or not isinstance(value, int) or not CHUNK_SIZE_MIN <= value <= CHUNK_SIZE_MAX:
        raise ConfigError(f"{what}={value!r}: expected an integer in [{CHUNK_SIZE_MIN}, {CHUNK_SIZE_MAX}]")
    return value

PAYLOAD_FORMAT_VERSION = 1
KEY_BYTES = 16
EXTRA_TAG = b"\x00shmkv-extra-inputs-v1\x00"
LOSSY_TAG = b"\x00shmkv-lossy-v1\x00"
LOOKAHEAD_TAG = b"\x00shmkv-lookahead-v1\x00"
STATE_TAG = b"\x00shmkv-recurrent-state-v1\x00"


def lossy_key(key: bytes, form: str) -> bytes:
    """The key of the lossy `form` of the chunk (or namespace root) keyed
    `key`: a hash input no exact key has (it starts with a tag, not a key)."""
    if form not in LOSSY_FORMS:
        raise ConfigError(f"lossy form {form!r}: expected one of {list(LOSSY_FORMS)}")
    if len(key) != KEY_BYTES:
        raise ValueError(f"a key is {KEY_BYTES} bytes, got {len(key)}")
    return xxhash.xxh3_128_digest(LOSSY_TAG + form.encode() + b"\x00" + key)


def lookahead_key(key: bytes, tokens: Sequence[int] | np.ndarray, extras: bytes = b"") -> bytes:
    """The key of the chunk keyed `key` as written by an engine whose drafter
    read `tokens` past the chunk's end (`extras`: ExtraInputs.for_range of
    them): a hash input no exact key has (it starts with a tag), and the
    lookahead's length is in it."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a key is {KEY_BYTES} bytes, got {len(key)}")
    raw = _token_bytes(tokens)
    return xxhash.xxh3_128_digest(LOOKAHEAD_TAG + len(raw).to_bytes(4, "little") + key + raw
                                  + len(extras).to_bytes(4, "little") + extras)


def state_key(key: bytes) -> bytes:
    """The key of the recurrent state (Mamba, gated delta net) after the
    last token of the unit keyed `key`: stored beside the unit's attention
    KV, never under a key an attention chunk has (it starts with a tag)."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a key is {KEY_BYTES} bytes, got {len(key)}")
    return xxhash.xxh3_128_digest(STATE_TAG + key)


def mix_extras(prev: bytes, extras: bytes) -> bytes:
    """The 16 bytes a chunk with extra inputs chains from (prev itself when it has none)."""
    return prev if not extras else xxhash.xxh3_128_digest(prev + EXTRA_TAG + extras)


@dataclass(frozen=True)
class MultiModalItem:
    """One multimodal input of a prompt: its placeholder tokens are
    [offset, offset + length); `identifier` names its content (vLLM's
    mm_hash / identifier)."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, eq=False)
class ExtraInputs:
    """Inputs of one request, besides its token ids, that change the KV of
    the tokens they cover: multimodal items and prompt embeddings."""

    mm: tuple[MultiModalItem, ...] = ()
    embeds: np.ndarray | None = None  # [num_prompt_tokens, ...] prompt embeddings, any dtype (raw bytes hashed)
    token_mask: np.ndarray | None = None  # [num_prompt_tokens] bool: position given as a token id (mixed prompts)

    def __post_init__(self) -> None:
        if self.embeds is not None:
            object.__setattr__(self, "_embeds_digests", {})

    def for_range(self, start: int, end: int) -> bytes:
        """Canonical bytes of what covers tokens [start, end) (b"" if nothing)."""
        items: list[list] = []
        for f in self.mm:
            if f.length > 0 and f.offset < end and f.offset + f.length > start:
                items.append(["mm", str(f.identifier), int(f.offset) - start])
        if self.embeds is not None:
            cache = self._embeds_digests  # type: ignore[attr-defined]
            d = cache.get((start, end))
            if d is None:
                rows = np.ascontiguousarray(self.embeds[start:end])
                h = xxhash.xxh3_128(rows.view(np.uint8).tobytes())
                if self.token_mask is not None:
                    h.update(b"\x00mask\x00" + np.asarray(self.token_mask[start:end], dtype=np.uint8).tobytes())
                d = cache[(start, end)] = [str(rows.dtype), list(rows.shape), h.hexdigest()]
            items.append(["embeds", *d])
        return json.dumps(items, separators=(",", ":")).encode() if items else b""

    @property
    def empty(self) -> bool:
        return not self.mm and self.embeds is None


@dataclass(frozen=True)
class Namespace:
    """Everything that makes cached bytes incompatible between engines."""

    model_id: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    chunk_size: int = 256
    mla: bool = False
    tp_size: int = 1
    tp_rank: int = 0
    payload: str = "blocks"  # "blocks" (raw paged blocks) or "tokens" (canonical)
    attention_layout: str = ""  # e.g. "cpu:LBHNC", "cuda:NHD", "cuda:HND", "cuda:kv-split", "mla"
    block_size: int = 0  # part of the key only when the payload is raw blocks
    isa: str = ""  # CPU attention instruction-set variant for raw blocks (vec, amx...)
    format_version: int = PAYLOAD_FORMAT_VERSION
    cache_salt: str | None = None
    extra: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        check_chunk_size(self.chunk_size)
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank {self.tp_rank} must be in [0, tp_size={self.tp_size})")
        if self.payload not in ("blocks", "tokens"):
            raise ConfigError(f"payload must be 'blocks' or 'tokens', got {self.payload!r}")
        if self.payload == "blocks" and self.block_size <= 0:
            raise ConfigError("a raw-block payload needs block_size > 0 in its namespace")
        if self.payload == "blocks" and self.chunk_size % self.block_size:
            raise ConfigError(
                f"chunk_size {self.chunk_size} must be a multiple of block_size {self.block_size} "
                "for raw-block payloads"
            )

    def encode(self) -> bytes:
        """Canonical bytes of the namespace (sorted-key JSON)."""
        d = asdict(self)
        if self.payload == "tokens":
            d["block_size"] = 0  # canonical payloads are block-size independent
        return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()

    def root_key(self) -> bytes:
        return xxhash.xxh3_128_digest(self.encode())

    def with_salt(self, salt: str | None) -> Namespace:
        return self if salt == self.cache_salt else replace(self, cache_salt=salt)


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must be in [0, 2^32)")
    return arr.astype("<u4", copy=False).tobytes()


def chain_key(prev: bytes, tokens: Sequence[int] | np.ndarray) -> bytes:
    """xxh3_128(prev || tokens as little-endian uint32)."""
    return xxhash.xxh3_128_digest(prev + _token_bytes(tokens))


def chunk_keys(
    root: bytes | Namespace, tokens: Sequence[int] | np.ndarray, chunk_size: int | None = None,
    extras: ExtraInputs | None = None,
) -> list[tuple[int, int, bytes]]:
    """(start, end, key) of every FULL chunk of `tokens`, in prefix order."""
    if isinstance(root, Namespace):
        chunk_size = chunk_size or root.chunk_size
        root = root.root_key()
    if not chunk_size or chunk_size <= 0:
        raise ValueError("chunk_size must be > 0")
    raw = _token_bytes(tokens)
    out: list[tuple[int, int, bytes]] = []
    k = root
    step = chunk_size * 4
    for i in range(len(raw) // step):
        if extras is not None:
            k = mix_extras(k, extras.for_range(i * chunk_size, (i + 1) * chunk_size))
        k = xxhash.xxh3_128_digest(k + raw[i * step:(i + 1) * step])
        out.append((i * chunk_size, (i + 1) * chunk_size, k))
    return out


def piece_key(prev: bytes, tokens: Sequence[int] | np.ndarray, extras: bytes = b"") -> bytes:
    """Key of a partial chunk (a block-aligned prefix of the chunk after the
    one keyed `prev`; `extras` = ExtraInputs.for_range of its tokens). Same
    construction as a chunk; shorter input."""
    return chain_key(mix_extras(prev, extras), tokens)
