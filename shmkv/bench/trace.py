"""Request traces in the Mooncake format (one JSON object a line:
`timestamp` ms, `input_length`, `output_length`, `hash_ids` of 512-token
prefix blocks), scaled and sliced for a small machine, expanded into the
same token prompts in every arm and every process, and their reuse ceilings.

Invariants: a hash id always expands to the same tokens (seeded by the id and
the run's seed, never by Python's hash()); two requests that share their
first k ids share their first k blocks of tokens; the ceilings count only
reuse that vLLM could take (a prompt's last token is always computed).
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import xxhash

TRACE_BLOCK = 512  # tokens of one hash id in the Mooncake release


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def conversation(self) -> int:
        """Its conversation: the first hash id after the system block (the first id, shared by all)."""
        return self.hash_ids[1] if len(self.hash_ids) > 1 else self.hash_ids[0]


def load(path: str) -> list[TraceRequest]:
    """Every request of a Mooncake-format JSONL file, in timestamp order; a
    malformed line raises ValueError naming its line number."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                r = TraceRequest(float(d["timestamp"]), int(d["input_length"]), int(d["output_length"]),
                                 tuple(int(h) for h in d["hash_ids"]))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a Mooncake trace line ({e})") from None
            if r.input_length <= 0 or not r.hash_ids:
                raise ValueError(f"{path}:{n}: input_length {r.input_length} with {len(r.hash_ids)} hash ids")
            out.append(r)
    return sorted(out, key=lambda r: r.timestamp_ms)


def scaled(reqs: Iterable[TraceRequest], scale: int) -> list[TraceRequest]:
    """Every length divided by `scale` (a block of TRACE_BLOCK tokens becomes
    TRACE_BLOCK // scale), the hash ids kept; at least one token of output."""
    if scale < 1 or TRACE_BLOCK % scale:
        raise ValueError(f"scale={scale}: expected a divisor of {TRACE_BLOCK}")
    return [replace(r, input_length=max(1, -(-r.input_length // scale)),
                    output_length=max(1, r.output_length // scale)) for r in reqs]


def first_minutes(reqs: Sequence[TraceRequest], minutes: float) -> list[TraceRequest]:
    return [r for r in reqs if r.timestamp_ms < minutes * 60_000]


def sample_conversations(reqs: Sequence[TraceRequest], k: int, seed: int = 0) -> list[TraceRequest]:
    """`k` conversations drawn at random with all their turns, in trace order."""
    convs = sorted({r.conversation for r in reqs})
    chosen = set(random.Random(seed).sample(convs, min(k, len(convs))))
    return [r for r in reqs if r.conversation in chosen]


def block_tokens(hash_id: int, block: int, vocab: int, seed: int = 0) -> np.ndarray:
    """The tokens of one hash id (ids 3.. vocab-1: clear of special tokens)."""
    rng = np.random.default_rng([seed, hash_id])
    return rng.integers(3, vocab, block, dtype=np.int64)


def prompt_tokens(r: TraceRequest, block: int, vocab: int, seed: int = 0) -> list[int]:
    """The request's prompt: its hash ids' blocks, cut to its input length."""
    need = -(-r.input_length // block)
    ids = list(r.hash_ids[:need])
    # NOTE: a trace may list fewer ids than its length needs (rounding in a scaled copy): the rest of
    # the prompt is this request's own (seeded by its position and timestamp)
    while len(ids) < need:
        ids.append(-(1 + int(xxhash.xxh3_64_intdigest(f"{r.timestamp_ms}:{r.hash_ids}:{len(ids)}".encode()) >> 1)))
    toks = np.concatenate([block_tokens(h, block, vocab, seed) for h in ids])[: r.input_length]
    return toks.tolist()


def _keys(tokens: Sequence[int], unit: int) -> list[bytes]:
    """Prefix-chained keys of the prompt's whole units of `unit` tokens."""
    arr = np.asarray(tokens, dtype=np.int64)
    out, prev = [], b""
    for i in range(len(arr) // unit):
        prev = xxhash.xxh3_128_digest(prev + arr[i * unit:(i + 1) * unit].tobytes())
        out.append(prev)
    return out


def _reusable_units(n_tokens: int, unit: int) -> int:
    """Units vLLM could take from a cache: the last token is always computed."""
    return max(0, n_tokens - 1) // unit


def _prefix_hit(p: Sequence[int], unit: int, present: Callable[[bytes], bool]) -> tuple[list[bytes], int]:
    """(the prompt's unit keys, how many of its leading reusable units are present)."""
    keys = _keys(p, unit)
    k = 0
    for key in keys[:_reusable_units(len(p), unit)]:
        if not present(key):
            break
        k += 1
    return keys, k


def ceiling(prompts: Sequence[Sequence[int]], unit: int) -> int:
    """Prompt tokens any cache of `unit`-token blocks could serve, unlimited:
    each prompt's longest prefix of units seen in an earlier prompt."""
    seen: set[bytes] = set()
    total = 0
    for p in prompts:
        keys, k = _prefix_hit(p, unit, seen.__contains__)
        total += k * unit
        seen.update(keys)
    return total


def lru_ceiling(prompts: Sequence[Sequence[int]], unit: int, capacity_units: int) -> int:
    """The same for an LRU cache of `capacity_units` units (a byte budget over
    a unit's KV bytes): what one shared cache of that size could serve."""
    cache: OrderedDict[bytes, None] = OrderedDict()

    def hit(key: bytes) -> bool:
        if key not in cache:
            return False
        cache.move_to_end(key)
        return True

    total = 0
    for p in prompts:
        keys, k = _prefix_hit(p, unit, hit)
        total += k * unit
        for key in keys:
            cache[key] = None
            cache.move_to_end(key)
        while len(cache) > capacity_units:
            cache.popitem(last=False)
    return total


def working_set_units(prompts: Sequence[Sequence[int]], unit: int) -> int:
    """Distinct units of the slice: a cache this large holds all of it."""
    return len({k for p in prompts for k in _keys(p, unit)})


def write_slice(reqs: Sequence[TraceRequest], outputs: Sequence[int], path: str) -> None:
    """A slice as a Mooncake-format file for vLLM's timed_trace dataset:
    timestamps from 0 (ms), each request's output length as replayed."""
    t0 = reqs[0].timestamp_ms if reqs else 0.0
    with open(path, "w") as f:
        for r, out in zip(reqs, outputs):
            f.write(json.dumps({"timestamp": r.timestamp_ms - t0, "input_length": r.input_length,
                                "output_length": out, "hash_ids": list(r.hash_ids)}) + "\n")
